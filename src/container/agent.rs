//! The host's end of the agent protocol (`ember_agent`): requests and their
//! responses matched by id, processes' stdio routed by handle, and the
//! agent's events handed to the pod.

use super::ContainerError;
use ember_agent::{Event, Handle, Request, RequestEnvelope, Response, ResponseEnvelope, kind};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

/// Where a process's output goes.
pub type Sink = Box<dyn Write + Send>;

/// What the agent reports, besides answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// A process exited; all of its output has been written to its sinks,
    /// which are closed.
    Exited {
        /// The process.
        handle: Handle,
        /// Exit code, or 128 + signal.
        status: i32,
    },
    /// The OOM killer killed a process of a container.
    Oom {
        /// The container.
        container: String,
    },
    /// The stream ended: the agent (and its VM) are gone.
    Gone,
}

#[derive(Default)]
struct Shared {
    pending: HashMap<u64, mpsc::Sender<Response>>,
    sinks: HashMap<Handle, (Option<Sink>, Option<Sink>)>,
    gone: bool,
}

/// A connected agent.
pub struct AgentClient {
    writer: Mutex<Box<dyn Write + Send>>,
    next_id: AtomicU64,
    shared: Arc<Mutex<Shared>>,
    /// How long a request may wait for its answer.
    timeout: Duration,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl AgentClient {
    /// Talks to the agent over `reader`/`writer`; `notes` gets its events
    /// (from the reader thread, in stream order).
    pub fn new(
        reader: Box<dyn Read + Send>,
        writer: Box<dyn Write + Send>,
        timeout: Duration,
        notes: impl Fn(Note) + Send + 'static,
    ) -> AgentClient {
        let shared = Arc::new(Mutex::new(Shared::default()));
        {
            let shared = shared.clone();
            std::thread::spawn(move || read_loop(reader, shared, notes));
        }
        AgentClient {
            writer: Mutex::new(writer),
            next_id: AtomicU64::new(1),
            shared,
            timeout,
        }
    }

    /// Sends `request` and waits for its answer; an agent's `Error` is an `Err`.
    pub fn request(&self, request: Request) -> Result<Response, ContainerError> {
        self.request_within(request, self.timeout)
    }

    /// As [`AgentClient::request`], with its own timeout.
    pub fn request_within(
        &self,
        request: Request,
        timeout: Duration,
    ) -> Result<Response, ContainerError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        {
            let mut s = lock(&self.shared);
            if s.gone {
                return Err(ContainerError::AgentGone);
            }
            s.pending.insert(id, tx);
        }
        let payload = serde_json::to_vec(&RequestEnvelope { id, request })
            .map_err(|e| ContainerError::Agent(format!("cannot encode a request: {e}")))?;
        self.send(kind::REQUEST, &payload)?;
        match rx.recv_timeout(timeout) {
            Ok(Response::Error(e)) => Err(ContainerError::Agent(e)),
            Ok(r) => Ok(r),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                lock(&self.shared).pending.remove(&id);
                Err(ContainerError::Timeout(timeout.as_secs()))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(ContainerError::AgentGone),
        }
    }

    fn send(&self, kind: u8, payload: &[u8]) -> Result<(), ContainerError> {
        let mut w = lock(&self.writer);
        ember_agent::write_frame(&mut **w, kind, payload).map_err(|_| ContainerError::AgentGone)
    }

    /// Registers where `handle`'s output goes: before it starts.
    pub fn attach(&self, handle: Handle, stdout: Option<Sink>, stderr: Option<Sink>) {
        lock(&self.shared).sinks.insert(handle, (stdout, stderr));
    }

    /// Bytes for `handle`'s stdin.
    pub fn stdin(&self, handle: Handle, bytes: &[u8]) -> Result<(), ContainerError> {
        for chunk in bytes.chunks(ember_agent::DATA_CHUNK) {
            self.send(kind::STDIN, &ember_agent::data_payload(handle, chunk))?;
        }
        Ok(())
    }

    /// Ends `handle`'s stdin.
    pub fn close_stdin(&self, handle: Handle) -> Result<(), ContainerError> {
        self.send(kind::STDIN_EOF, &ember_agent::data_payload(handle, &[]))
    }

    /// Whether the stream has ended.
    pub fn is_gone(&self) -> bool {
        lock(&self.shared).gone
    }
}

fn read_loop(mut reader: Box<dyn Read + Send>, shared: Arc<Mutex<Shared>>, notes: impl Fn(Note)) {
    loop {
        let frame = match ember_agent::read_frame(&mut *reader) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                log::warn!("agent stream: {e}");
                break;
            }
        };
        match frame.kind {
            kind::RESPONSE => match serde_json::from_slice::<ResponseEnvelope>(&frame.payload) {
                Ok(r) => {
                    if let Some(tx) = lock(&shared).pending.remove(&r.id) {
                        let _ = tx.send(r.response);
                    }
                }
                Err(e) => log::warn!("agent: bad response: {e}"),
            },
            kind::STDOUT | kind::STDERR => {
                let Some((handle, bytes)) = ember_agent::split_data(&frame.payload) else {
                    continue;
                };
                let mut s = lock(&shared);
                if let Some(pair) = s.sinks.get_mut(&handle) {
                    let slot = if frame.kind == kind::STDOUT {
                        &mut pair.0
                    } else {
                        &mut pair.1
                    };
                    // A reader that went away (a closed FIFO) drops the rest.
                    let failed = slot
                        .as_mut()
                        .and_then(|w| w.write_all(bytes).and_then(|_| w.flush()).err());
                    if let Some(e) = failed {
                        log::warn!(
                            "process {handle}: its {} is not taken ({e}): the rest of it is dropped",
                            if frame.kind == kind::STDOUT {
                                "output"
                            } else {
                                "error output"
                            }
                        );
                        *slot = None;
                    }
                }
            }
            kind::EVENT => match serde_json::from_slice::<Event>(&frame.payload) {
                Ok(Event::Exited { handle, status }) => {
                    // Its output is all in: closing the sinks ends the readers' streams.
                    lock(&shared).sinks.remove(&handle);
                    notes(Note::Exited { handle, status });
                }
                Ok(Event::Oom { container }) => notes(Note::Oom { container }),
                Err(e) => log::warn!("agent: bad event: {e}"),
            },
            other => log::warn!("agent: unexpected frame kind {other:#x}"),
        }
    }
    {
        let mut s = lock(&shared);
        s.gone = true;
        // Waiting requests see the stream's end.
        s.pending.clear();
        s.sinks.clear();
    }
    notes(Note::Gone);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// A fake agent on the other end of a socket pair answers, streams
    /// output and reports an exit; the client routes each.
    #[test]
    fn requests_output_and_exits_are_routed() {
        let (host, guest) = UnixStream::pair().unwrap();
        let fake = std::thread::spawn(move || {
            let mut r = guest.try_clone().unwrap();
            let mut w = guest;
            let f = ember_agent::read_frame(&mut r).unwrap().unwrap();
            let req: RequestEnvelope = serde_json::from_slice(&f.payload).unwrap();
            assert_eq!(req.request, Request::Hello);
            let out = ember_agent::data_payload(5, b"hello\n");
            ember_agent::write_frame(&mut w, kind::STDOUT, &out).unwrap();
            let exit = serde_json::to_vec(&Event::Exited {
                handle: 5,
                status: 3,
            })
            .unwrap();
            ember_agent::write_frame(&mut w, kind::EVENT, &exit).unwrap();
            let resp = ResponseEnvelope {
                id: req.id,
                response: Response::Error("nope".into()),
            };
            ember_agent::write_frame(&mut w, kind::RESPONSE, &serde_json::to_vec(&resp).unwrap())
                .unwrap();
        });
        let (tx, rx) = mpsc::channel();
        let client = AgentClient::new(
            Box::new(host.try_clone().unwrap()),
            Box::new(host),
            Duration::from_secs(10),
            move |n| tx.send(n).unwrap(),
        );
        let out = Arc::new(Mutex::new(Vec::new()));
        struct Shared(Arc<Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        client.attach(5, Some(Box::new(Shared(out.clone()))), None);
        let e = client.request(Request::Hello).unwrap_err();
        assert_eq!(e.to_string(), "nope");
        fake.join().unwrap();
        assert_eq!(
            rx.recv().unwrap(),
            Note::Exited {
                handle: 5,
                status: 3
            }
        );
        assert_eq!(&*out.lock().unwrap(), b"hello\n");
        assert_eq!(rx.recv().unwrap(), Note::Gone);
        assert!(client.is_gone());
        assert!(matches!(
            client.request(Request::Hello),
            Err(ContainerError::AgentGone)
        ));
    }
}
