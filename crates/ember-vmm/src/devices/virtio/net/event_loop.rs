//! The network device's I/O thread: one epoll over both queues' eventfds, the
//! backend's descriptor (watched only while a frame can be taken), a timer for the
//! rate limits and the link's return, and the kill eventfd.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use super::handler::{NetHandler, RX, TX};
use super::{DEVICE, Link};

const KILL: u64 = u64::MAX;
const BACKEND: u64 = 10;
const TIMER: u64 = 11;
const LINK: u64 = 12;
/// How long the link stays down after the driver has seen it so: long enough for a
/// driver's reaction to one interrupt to be over before the next comes.
const LINK_SETTLE: Duration = Duration::from_millis(20);
/// The link comes up after this even if the driver never looks.
const LINK_LONGEST_DOWN: Duration = Duration::from_secs(2);

pub(super) fn run(
    mut h: NetHandler,
    features: u64,
    evts: [EventFd; 2],
    link: Arc<Link>,
    seen_down: EventFd,
    kill: EventFd,
) {
    // Here, not on the vCPU that activated the device: its filter allows KVM's
    // ioctls only.
    if let Err(e) = h.backend.set_offloads(features) {
        crate::guest_warn!("{DEVICE}: the backend refused the offloads {features:#x}: {e}");
        h.irq.set_needs_reset();
        return;
    }
    if let Err(e) = serve(&mut h, &evts, &link, &seen_down, &kill) {
        crate::guest_warn!("{DEVICE}: I/O thread stopped: {e}");
    }
}

/// The I/O thread's loop. One function: one epoll wait and one arm per
/// source (kill, queues, backend, timer, link), the state they share local.
fn serve(
    h: &mut NetHandler,
    evts: &[EventFd; 2],
    link: &Link,
    seen_down: &EventFd,
    kill: &EventFd,
) -> io::Result<()> {
    let epoll = Epoll::new()?;
    let add = |fd: i32, events: EventSet, token: u64| {
        epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))
    };
    add(kill.as_raw_fd(), EventSet::IN, KILL)?;
    add(evts[RX].as_raw_fd(), EventSet::IN, RX as u64)?;
    add(evts[TX].as_raw_fd(), EventSet::IN, TX as u64)?;
    add(seen_down.as_raw_fd(), EventSet::IN, LINK)?;
    let mut timer = TimerFd::new()?;
    add(timer.as_raw_fd(), EventSet::IN, TIMER)?;
    let backend_fd = h.backend.fd();
    let mut watching = h.wants_backend();
    add(
        backend_fd,
        if watching {
            EventSet::IN
        } else {
            EventSet::empty()
        },
        BACKEND,
    )?;
    let mut link_up_at = link
        .is_changing()
        .then(|| Instant::now() + LINK_LONGEST_DOWN);
    let mut armed: Option<Instant> = None;

    // Frames may already wait either way (a restored device's queues).
    h.process_tx();
    h.process_rx();
    h.raise_interrupt();

    let mut events = [EpollEvent::default(); 8];
    loop {
        let deadline = match (h.deadline(), link_up_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if deadline != armed {
            match deadline {
                Some(d) => {
                    let after = d.saturating_duration_since(Instant::now());
                    timer.reset(after.max(Duration::from_micros(1)), None)?;
                }
                None => timer.clear()?,
            }
            armed = deadline;
        }
        let want = h.wants_backend();
        if want != watching {
            let events = if want {
                EventSet::IN
            } else {
                EventSet::empty()
            };
            epoll.ctl(
                ControlOperation::Modify,
                backend_fd,
                EpollEvent::new(events, BACKEND),
            )?;
            watching = want;
        }
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        for ev in &events[..n] {
            match ev.data() {
                KILL => return Ok(()),
                BACKEND => h.process_rx(),
                TIMER => {
                    let _ = timer.wait();
                    armed = None;
                    let now = Instant::now();
                    if link_up_at.is_some_and(|t| t <= now) {
                        link_up_at = None;
                        link.bring_up(&h.irq);
                    }
                    h.on_timer(now);
                }
                LINK => {
                    let _ = seen_down.read();
                    let settle = Instant::now() + LINK_SETTLE;
                    link_up_at = Some(link_up_at.map_or(settle, |t| t.min(settle)));
                }
                q => {
                    // Drain first: a notification racing with the work wakes us again.
                    let _ = evts[q as usize].read();
                    if q as usize == TX {
                        h.process_tx();
                    } else {
                        h.process_rx();
                    }
                }
            }
        }
        // Once for all this wake-up did, both queues.
        h.raise_interrupt();
    }
}
