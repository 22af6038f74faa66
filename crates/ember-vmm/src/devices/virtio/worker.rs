//! Device threads: one per active device, each owning an epoll over its queue eventfds and
//! a kill eventfd, so queue notifications (ioeventfds) never run device code on a vCPU.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::thread::JoinHandle;

use crate::seccomp::{self, Thread};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// A running device thread and the eventfd that asks it to stop.
#[derive(Debug)]
pub(crate) struct Worker {
    kill: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts `body` on a thread called `name` under the seccomp list of
    /// `kind`; `body` gets the kill eventfd to watch.
    pub(crate) fn spawn<F>(name: String, kind: Thread, body: F) -> io::Result<Self>
    where
        F: FnOnce(EventFd) + Send + 'static,
    {
        let kill = EventFd::new(EFD_NONBLOCK)?;
        let theirs = kill.try_clone()?;
        let thread = seccomp::spawn(name, kind, move || body(theirs))?;
        Ok(Self {
            kill,
            thread: Some(thread),
        })
    }

    /// Asks the thread to stop and waits until it has.
    pub(crate) fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        if let Err(e) = self.kill.write(1) {
            crate::guest_warn!("virtio: failed to signal a device thread to stop: {e}");
        }
        if thread.join().is_err() {
            crate::guest_warn!("virtio: a device thread panicked");
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What a simple (non-block) device does on its thread.
pub(crate) trait QueueHandler: Send + 'static {
    /// The driver notified queue `index`.
    fn process_queue(&mut self, index: usize);
    /// The optional input fd is readable (or hung up).
    fn process_input(&mut self) {}
    /// Whether the input fd should be watched right now. Returning false applies
    /// back-pressure: nothing more is read until the guest offers buffers.
    fn wants_input(&self) -> bool {
        false
    }
}

/// Starts a simple device's thread: `handler` serves `queue_evts` (and `input`, if any)
/// until the returned worker is stopped or dropped.
pub(crate) fn spawn_queue_worker<H: QueueHandler>(
    name: String,
    kind: Thread,
    handler: H,
    queue_evts: Vec<EventFd>,
    input: Option<RawFd>,
) -> Result<Worker, super::ActivateError> {
    Worker::spawn(name, kind, move |kill| {
        run_queue_loop(handler, queue_evts, input, kill)
    })
    .map_err(super::ActivateError::Spawn)
}

/// Activates a device that has one queue and no input (rng, pmem): checks the transport
/// handed over exactly one ready queue and starts a thread called `name` serving it with
/// the handler `make` builds around it.
pub(crate) fn activate_single_queue<H: QueueHandler>(
    name: &str,
    kind: Thread,
    mut queues: Vec<super::ActiveQueue>,
    make: impl FnOnce(virtio_queue::Queue) -> H,
) -> Result<Worker, super::ActivateError> {
    super::check_queues(&queues, 1)?;
    let super::ActiveQueue { queue, evt } = queues.remove(0);
    spawn_queue_worker(name.into(), kind, make(queue), vec![evt], None)
}

/// Epoll token of the kill eventfd; queue `i` uses token `i`.
const KILL_TOKEN: u64 = u64::MAX;
/// Epoll token of the optional input fd.
const INPUT_TOKEN: u64 = u64::MAX - 1;
/// How many events one `epoll_wait` returns at most.
const EVENTS_PER_WAIT: usize = 8;

/// The loop of a simple device thread: waits on the queue eventfds, the kill eventfd and an
/// optional input fd, and dispatches to `handler` until killed.
pub(crate) fn run_queue_loop<H: QueueHandler>(
    mut handler: H,
    queue_evts: Vec<EventFd>,
    input: Option<RawFd>,
    kill: EventFd,
) {
    if let Err(e) = queue_loop(&mut handler, &queue_evts, input, &kill) {
        crate::guest_warn!("virtio: device thread stopped: {e}");
    }
}

fn queue_loop<H: QueueHandler>(
    handler: &mut H,
    queue_evts: &[EventFd],
    input: Option<RawFd>,
    kill: &EventFd,
) -> io::Result<()> {
    let epoll = Epoll::new()?;
    let add = |fd: RawFd, token: u64| {
        epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, token),
        )
    };
    add(kill.as_raw_fd(), KILL_TOKEN)?;
    for (i, evt) in queue_evts.iter().enumerate() {
        add(evt.as_raw_fd(), i as u64)?;
    }
    // The input fd stays registered; back-pressure switches its event mask off.
    let mut watching_input = false;
    if let Some(fd) = input {
        watching_input = handler.wants_input();
        let events = if watching_input {
            EventSet::IN
        } else {
            EventSet::empty()
        };
        epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(events, INPUT_TOKEN),
        )?;
    }

    let mut events = [EpollEvent::default(); EVENTS_PER_WAIT];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        for ev in &events[..n] {
            match ev.data() {
                KILL_TOKEN => return Ok(()),
                INPUT_TOKEN => handler.process_input(),
                i => {
                    let Some(evt) = queue_evts.get(i as usize) else {
                        continue;
                    };
                    // Drain the counter first so a notification racing with processing
                    // wakes us again rather than being lost.
                    let _ = evt.read();
                    handler.process_queue(i as usize);
                }
            }
        }
        if let Some(fd) = input {
            let want = handler.wants_input();
            if want != watching_input {
                let events = if want {
                    EventSet::IN
                } else {
                    EventSet::empty()
                };
                epoll.ctl(
                    ControlOperation::Modify,
                    fd,
                    EpollEvent::new(events, INPUT_TOKEN),
                )?;
                watching_input = want;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::thread;
    use std::time::{Duration, Instant};

    struct Counter(Arc<AtomicUsize>);
    impl QueueHandler for Counter {
        fn process_queue(&mut self, index: usize) {
            self.0.fetch_add(index + 1, Ordering::SeqCst);
        }
    }

    #[test]
    fn loop_dispatches_queue_events_and_stops_on_kill() {
        let hits = Arc::new(AtomicUsize::new(0));
        let evts = vec![
            EventFd::new(EFD_NONBLOCK).unwrap(),
            EventFd::new(EFD_NONBLOCK).unwrap(),
        ];
        let kick = evts[1].try_clone().unwrap();
        let handler = Counter(hits.clone());
        let mut worker = Worker::spawn("ember-test".into(), Thread::Block, move |kill| {
            run_queue_loop(handler, evts, None, kill)
        })
        .unwrap();
        kick.write(1).unwrap();
        let start = Instant::now();
        while hits.load(Ordering::SeqCst) != 2 {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "queue 1 never ran"
            );
            thread::sleep(Duration::from_millis(1));
        }
        worker.stop();
        worker.stop(); // idempotent
    }
}
