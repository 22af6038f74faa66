//! The virtio-blk I/O thread: one per device, owning an epoll over the queue eventfd, a
//! kill eventfd and the engine's completion eventfd, and driving a [`BlockHandler`].
//!
//! Out of work, the thread busy-polls the available ring and the engine's completions for
//! a short, adaptive window ([`PollWindow`], QEMU's `poll-max-ns` scheme) with
//! `VRING_USED_F_NO_NOTIFY` set, so a driver that submits again within the window never
//! exits to notify and the thread never sleeps. Only then does it clear the flag, look at
//! the ring once more (a request published before the driver saw the flag cleared comes
//! with no notification) and sleep in epoll.

use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::handler::BlockHandler;

/// How long the I/O thread busy-polls for more work before sleeping, adapted like QEMU's
/// event-loop polling (`poll-max-ns`, `poll-grow`, `poll-shrink`).
///
/// The measure is the *idle time*: from running out of work to the next work arriving,
/// whether polling found it or a notification woke the thread. Idle time within the
/// window is the sweet spot and changes nothing; beyond the window but within the maximum,
/// polling a little longer would have caught it, so the window doubles; beyond the
/// maximum, polling would have been wasted, so it halves, down to zero. An idle device
/// therefore costs at most a few windows of CPU before it only sleeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PollWindow {
    ns: u64,
    max_ns: u64,
}

/// The window grows from zero to this; below it, it drops to zero.
const POLL_GROW_START_NS: u64 = 4_000;

impl PollWindow {
    /// A window of at most `max` (zero: never poll), starting at `max`.
    pub(crate) fn new(max: Duration) -> Self {
        let max_ns = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        Self { ns: max_ns, max_ns }
    }

    /// How long to poll now.
    pub(crate) fn window(&self) -> Duration {
        Duration::from_nanos(self.ns)
    }

    /// Adapts to one idle period of length `idle`.
    pub(crate) fn record(&mut self, idle: Duration) {
        let idle = u64::try_from(idle.as_nanos()).unwrap_or(u64::MAX);
        if idle <= self.ns || self.max_ns == 0 {
            return;
        }
        if idle > self.max_ns {
            self.ns /= 2;
            if self.ns < POLL_GROW_START_NS {
                self.ns = 0;
            }
        } else {
            self.ns = self
                .ns
                .saturating_mul(2)
                .max(POLL_GROW_START_NS)
                .min(self.max_ns);
        }
    }
}

/// How often the I/O thread looks at its eventfds (for a kill, mainly) while polling keeps
/// finding work and it therefore never sleeps.
const EVENT_CHECK_PERIOD: Duration = Duration::from_millis(1);

/// Epoll tokens of the I/O thread.
const QUEUE_TOKEN: u64 = 0;
const KILL_TOKEN: u64 = 1;
const COMPLETION_TOKEN: u64 = 2;

/// The I/O thread body: runs until `kill`, then finishes what is in flight. It polls for
/// up to `poll_max` (adaptively) before sleeping; zero disables polling.
pub(crate) fn run(
    mut handler: BlockHandler,
    queue_evt: EventFd,
    kill: EventFd,
    poll_max: Duration,
) {
    let mut poll = Windows {
        guest: PollWindow::new(poll_max),
        engine: PollWindow::new(poll_max),
    };
    if let Err(e) = event_loop(&mut handler, &queue_evt, &kill, &mut poll) {
        crate::guest_warn!("virtio-blk: I/O thread failed: {e}");
    }
    handler.drain();
}

/// One poll window per thing the thread can be waiting for, since they keep different
/// times: with nothing in flight only the driver can bring work, and a polling driver
/// answers a completion within a microsecond or two; with I/O in flight the disk may take
/// far longer than is worth polling (`O_DIRECT`), and a shared window would then shrink
/// to nothing and make the driver notify again.
struct Windows {
    guest: PollWindow,
    engine: PollWindow,
}

impl Windows {
    fn for_state(&mut self, handler: &BlockHandler) -> &mut PollWindow {
        if handler.in_flight() > 0 {
            &mut self.engine
        } else {
            &mut self.guest
        }
    }
}

/// Busy-polls `handler` for up to `window` with notifications suppressed. Returns whether
/// it found work; if not, notifications are back on and the caller may sleep.
fn poll_for_work(handler: &mut BlockHandler, window: Duration) -> bool {
    if window.is_zero() || handler.is_broken() {
        return handler.resume_notifications();
    }
    let start = Instant::now();
    handler.suppress_notifications();
    loop {
        // Notifications stay off while there is work: the next poll follows the pass.
        if handler.has_work() {
            return true;
        }
        if start.elapsed() >= window {
            return handler.resume_notifications();
        }
        std::hint::spin_loop();
    }
}

fn event_loop(
    handler: &mut BlockHandler,
    queue_evt: &EventFd,
    kill: &EventFd,
    poll: &mut Windows,
) -> io::Result<()> {
    let epoll = Epoll::new()?;
    let add = |fd, token| {
        epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, token),
        )
    };
    add(queue_evt.as_raw_fd(), QUEUE_TOKEN)?;
    add(kill.as_raw_fd(), KILL_TOKEN)?;
    if let Some(fd) = handler.completion_notifier() {
        add(fd, COMPLETION_TOKEN)?;
    }
    let mut events = [EpollEvent::default(); 3];
    let mut last_look = Instant::now();
    // The driver may have published requests before we started watching.
    let mut work = true;
    loop {
        let mut more = false;
        if work {
            // Completions first: they make room for requests a full queue held back.
            handler.process_completions();
            handler.take_throttled();
            crate::seccomp::test_hook::block_request();
            more = handler.process_queue();
        }
        let idle = Instant::now();
        let window = poll.for_state(handler);
        // More than a queue's worth was waiting: no need to poll for it.
        work = more || poll_for_work(handler, window.window());
        if work && last_look.elapsed() < EVENT_CHECK_PERIOD {
            continue;
        }
        // Sleep; or, with work in hand, only look, so a kill is seen between passes.
        let timeout = if work { 0 } else { -1 };
        let n = match epoll.wait(timeout, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        last_look = Instant::now();
        if !work {
            window.record(last_look - idle);
        }
        let ready = |token| events[..n].iter().any(|e| e.data() == token);
        if ready(KILL_TOKEN) {
            return Ok(());
        }
        if ready(QUEUE_TOKEN) {
            // Read the counter before the pass, so a notification racing with it wakes
            // us again rather than being lost.
            let _ = queue_evt.read();
            work = true;
        }
        work |= ready(COMPLETION_TOKEN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::block::io::EngineKind;
    use crate::devices::virtio::block::test_rig::*;
    use crate::devices::virtio::test_utils::*;
    use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_IN};
    use virtio_bindings::virtio_ring::VRING_USED_F_NO_NOTIFY;
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn the_poll_window_adapts() {
        let us = Duration::from_micros;
        let mut p = PollWindow::new(us(32));
        assert_eq!(p.window(), us(32));
        // Work within the window: the sweet spot.
        p.record(us(3));
        assert_eq!(p.window(), us(32));
        // Idle longer than the maximum: halve, down to zero.
        for want in [16, 8, 4, 0, 0] {
            p.record(us(1000));
            assert_eq!(p.window(), us(want));
        }
        // Work soon after sleeping: polling would have caught it, grow.
        p.record(us(2));
        assert_eq!(p.window(), Duration::from_nanos(POLL_GROW_START_NS));
        p.record(us(6));
        assert_eq!(p.window(), us(8));
        p.record(us(20));
        assert_eq!(p.window(), us(16));
        p.record(us(30));
        p.record(us(30));
        assert_eq!(p.window(), us(32), "capped at the maximum");
        // Zero never polls.
        let mut off = PollWindow::new(Duration::ZERO);
        off.record(us(2));
        assert_eq!(off.window(), Duration::ZERO);
    }

    #[test]
    fn waiting_for_the_disk_and_for_the_driver_adapt_separately() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let mut h = rig.hold_handler(&vq);
        let max = Duration::from_micros(32);
        let mut win = Windows {
            guest: PollWindow::new(max),
            engine: PollWindow::new(max),
        };
        // A slow disk: every wait with I/O in flight is long.
        rig.header(HDR, VIRTIO_BLK_T_FLUSH, 0);
        add_chain(&vq, 0, &[r(HDR, 16), w(STATUS, 1)]);
        h.process_queue();
        for _ in 0..8 {
            win.for_state(&h).record(Duration::from_millis(1));
        }
        assert_eq!(win.engine.window(), Duration::ZERO);
        h.drain();
        // ...while the driver still answers within the window.
        assert_eq!(win.for_state(&h).window(), max);
    }

    /// Waits up to 5 s for `cond`.
    fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "timed out: {what}"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    #[test]
    fn the_io_thread_takes_unnotified_requests_while_polling_then_sleeps() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let h = rig.handler(&vq, EngineKind::Sync, false);
        let queue_evt = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        let kick = queue_evt.try_clone().unwrap();
        // A long window, so the test does not race it; it still ends.
        let window = Duration::from_millis(300);
        let mut worker = crate::devices::virtio::worker::Worker::spawn(
            "ember-blk-test".into(),
            crate::seccomp::Thread::Block,
            move |kill| run(h, queue_evt, kill, window),
        )
        .unwrap();
        rig.header(HDR, VIRTIO_BLK_T_IN, 1);
        add_chain(&vq, 0, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
        kick.write(1).unwrap();
        wait_for("first request", || vq.used_idx() == 1);
        // Polling now: the driver is told not to notify, and need not.
        wait_for("NO_NOTIFY set", || {
            vq.used_flags() == VRING_USED_F_NO_NOTIFY as u16
        });
        rig.mem
            .write_obj(VIRTIO_BLK_T_IN, GuestAddress(HDR + 0x40))
            .unwrap();
        rig.mem.write_obj(2u64, GuestAddress(HDR + 0x48)).unwrap();
        add_chain(&vq, 3, &[r(HDR + 0x40, 16), w(DATA, 512), w(STATUS, 1)]);
        // Never notified: polling takes it, or the look after polling does.
        wait_for("unnotified request", || vq.used_idx() == 2);
        assert_eq!(byte(&rig.mem, DATA), 2);
        // Out of work, the window runs out and notifications come back on.
        wait_for("NO_NOTIFY cleared", || vq.used_flags() == 0);
        // Sleeping now: a notified request still gets served.
        rig.header(HDR, VIRTIO_BLK_T_IN, 3);
        add_chain(&vq, 6, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
        kick.write(1).unwrap();
        wait_for("notified request", || vq.used_idx() == 3);
        worker.stop();
        assert_eq!(byte(&rig.mem, DATA), 3);
    }
}
