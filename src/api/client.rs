//! The control socket's client, for `ember ctl`, `ember snapshot` and the
//! appliance: typed requests and answers, and limits on how long it waits
//! for the connection and for the reply's first byte (which the server sends
//! as soon as it has read the request, so a long snapshot is not cut off).

use super::{BalloonReport, MemReport, Reply, Request, Response, SnapshotWritten, Status, decode};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;
use thiserror::Error;

/// How long a client waits for the connection, and then for the reply's
/// first byte, unless `EMBER_CTL_TIMEOUT` says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// The environment variable that sets the limit, in seconds.
pub const TIMEOUT_ENV: &str = "EMBER_CTL_TIMEOUT";

/// Client errors. Each says its cause once.
#[derive(Debug, Error)]
pub enum ClientError {
    /// Connecting, writing or reading failed.
    #[error("{what} {path}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The socket.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The VM did not answer in time.
    #[error(
        "timed out waiting for {what} {path} ({:.1} s; {TIMEOUT_ENV} sets the limit)",
        limit.as_secs_f64()
    )]
    TimedOut {
        /// What was awaited.
        what: &'static str,
        /// The socket.
        path: PathBuf,
        /// The limit.
        limit: Duration,
    },
    /// The reply was not the answer to the request.
    #[error("bad reply from {path}")]
    BadReply {
        /// The socket.
        path: PathBuf,
        /// What was wrong.
        source: super::BadReply,
    },
    /// The VM refused the request: its reason.
    #[error("{0}")]
    Refused(String),
}

/// A client of the control socket at one path.
#[derive(Debug, Clone)]
pub struct Client {
    path: PathBuf,
    timeout: Duration,
}

impl Client {
    /// A client of the socket at `path`, with `EMBER_CTL_TIMEOUT` (seconds)
    /// or [`DEFAULT_TIMEOUT`] as its limit.
    pub fn new(path: impl Into<PathBuf>) -> Client {
        let timeout = std::env::var(TIMEOUT_ENV)
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64);
        Client {
            path: path.into(),
            timeout,
        }
    }

    /// The same client with another limit.
    pub fn with_timeout(mut self, timeout: Duration) -> Client {
        self.timeout = timeout;
        self
    }

    /// Sends `req`; returns the answer, or [`ClientError::Refused`].
    pub fn send(&self, req: &Request) -> Result<Response, ClientError> {
        let line = serde_json::to_string(req).unwrap_or_default();
        let reply = self.exchange(&line)?;
        let reply = decode(req, &reply).map_err(|source| ClientError::BadReply {
            path: self.path.clone(),
            source,
        })?;
        match reply {
            Reply::Answer(answer) => Ok(answer),
            Reply::Refused(why) => Err(ClientError::Refused(why)),
        }
    }

    /// Running or paused, and the VM's shape.
    pub fn status(&self) -> Result<Status, ClientError> {
        match self.send(&Request::Status {})? {
            Response::Status(s) => Ok(s),
            _ => Err(self.mismatch()),
        }
    }

    /// Stops every vCPU.
    pub fn pause(&self) -> Result<(), ClientError> {
        self.send(&Request::Pause {}).map(drop)
    }

    /// Lets them run again.
    pub fn resume(&self) -> Result<(), ClientError> {
        self.send(&Request::Resume {}).map(drop)
    }

    /// Ends the VM.
    pub fn shutdown(&self) -> Result<(), ClientError> {
        self.send(&Request::Shutdown {}).map(drop)
    }

    /// Writes a snapshot of the paused VM to `dir` (absolute).
    pub fn snapshot(&self, dir: &Path) -> Result<SnapshotWritten, ClientError> {
        let req = Request::Snapshot {
            dir: dir.to_owned(),
        };
        match self.send(&req)? {
            Response::Snapshot(s) => Ok(s),
            _ => Err(self.mismatch()),
        }
    }

    /// Sets the balloon's target.
    pub fn balloon(&self, target_mib: u64) -> Result<(), ClientError> {
        self.send(&Request::Balloon { target_mib }).map(drop)
    }

    /// The balloon's size and the guest's statistics.
    pub fn balloon_stats(&self) -> Result<BalloonReport, ClientError> {
        match self.send(&Request::BalloonStats {})? {
            Response::Balloon(b) => Ok(b),
            _ => Err(self.mismatch()),
        }
    }

    /// Resizes the virtio-mem region so the guest has `size_mib` in all
    /// (none: only asks), and reports it.
    pub fn mem(&self, size_mib: Option<u64>) -> Result<MemReport, ClientError> {
        match self.send(&Request::Mem { size_mib })? {
            Response::Mem(m) => Ok(m),
            _ => Err(self.mismatch()),
        }
    }

    fn mismatch(&self) -> ClientError {
        ClientError::BadReply {
            path: self.path.clone(),
            source: super::BadReply("the answer to another request".into()),
        }
    }

    /// Writes `line` and returns the reply line, within the limits.
    fn exchange(&self, line: &str) -> Result<String, ClientError> {
        let io = |what| {
            let path = self.path.clone();
            move |source| ClientError::Io { what, path, source }
        };
        let timed_out = |what| ClientError::TimedOut {
            what,
            path: self.path.clone(),
            limit: self.timeout,
        };
        let mut stream = match connect(&self.path, self.timeout) {
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                return Err(timed_out("the connection to"));
            }
            r => r.map_err(io("cannot connect to"))?,
        };
        stream
            .write_all(format!("{line}\n").as_bytes())
            .map_err(io("cannot write to"))?;
        stream
            .set_read_timeout(Some(self.timeout))
            .map_err(io("cannot read from"))?;
        let mut first = [0u8; 1];
        loop {
            match stream.read(&mut first) {
                Ok(0) => return Err(io("no reply from")(io::ErrorKind::UnexpectedEof.into())),
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(timed_out("a reply from"));
                }
                Err(e) => return Err(io("cannot read from")(e)),
            }
        }
        // The rest may take as long as the request does (a snapshot).
        stream
            .set_read_timeout(None)
            .map_err(io("cannot read from"))?;
        let mut reply = vec![first[0]];
        BufReader::new(stream)
            .read_until(b'\n', &mut reply)
            .map_err(io("cannot read from"))?;
        Ok(String::from_utf8_lossy(&reply).into_owned())
    }
}

/// Connects to `path`, giving up after `limit` (a connect blocks while the
/// server's backlog is full). A connect still blocked then is left to its
/// thread.
fn connect(path: &Path, limit: Duration) -> io::Result<UnixStream> {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_owned();
    std::thread::Builder::new()
        .name("ember-ctl-connect".into())
        .spawn(move || {
            let _ = tx.send(UnixStream::connect(p));
        })?;
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
}

/// Sends one request line as given (any JSON, for tests of the server's
/// refusals) and returns the reply as JSON.
pub fn call(path: &Path, request: &serde_json::Value) -> Result<serde_json::Value, ClientError> {
    let client = Client::new(path);
    let reply = client.exchange(&request.to_string())?;
    serde_json::from_str(&reply).map_err(|e| ClientError::BadReply {
        path: path.to_owned(),
        source: super::BadReply(e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::time::Instant;

    /// A listening socket, in a directory removed when the test ends.
    fn socket(name: &str) -> (ember_testing::TempFile, UnixListener) {
        let p = ember_testing::TempFile::new("client", name);
        let l = UnixListener::bind(&p).unwrap();
        (p, l)
    }

    /// A server that accepts and never answers: the client gives up at its
    /// limit and says what it waited for, in one line.
    #[test]
    fn a_silent_server_times_out_in_one_line() {
        let (path, listener) = socket("silent");
        let held = std::thread::spawn(move || listener.accept().map(|(s, _)| s));
        let client = Client::new(&path).with_timeout(Duration::from_millis(200));
        let start = Instant::now();
        let e = client.status().unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(matches!(e, ClientError::TimedOut { .. }), "{e:?}");
        let msg = ember_vmm::error_chain(&e);
        assert!(
            msg.starts_with("timed out waiting for a reply from"),
            "{msg}"
        );
        assert!(!msg.contains('\n'), "{msg}");
        drop(held.join());
        let _ = std::fs::remove_file(&path);
    }

    /// After the first byte, the client waits for the rest however long it
    /// takes; refusals come back as the VM's reason.
    #[test]
    fn the_rest_of_a_reply_may_take_longer_than_the_limit() {
        let (path, listener) = socket("slow");
        let server = std::thread::spawn(move || {
            for reply in [
                r#"{"ok":true,"memory_bytes":1,"state_bytes":2,"in_flight":0,"ms":9.0}"#,
                r#"{"ok":false,"error":"the VM has ended"}"#,
            ] {
                let (mut s, _) = listener.accept().unwrap();
                let mut line = String::new();
                BufReader::new(&s).read_line(&mut line).unwrap();
                s.write_all(b"{").unwrap();
                std::thread::sleep(Duration::from_millis(400));
                s.write_all(format!("{}\n", &reply[1..]).as_bytes())
                    .unwrap();
            }
        });
        let client = Client::new(&path).with_timeout(Duration::from_millis(200));
        let w = client.snapshot(Path::new("/s")).unwrap();
        assert_eq!(w.state_bytes, 2);
        match client.pause() {
            Err(ClientError::Refused(why)) => assert_eq!(why, "the VM has ended"),
            other => panic!("{other:?}"),
        }
        server.join().unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn no_socket_says_so_once() {
        let path = std::env::temp_dir().join(format!("ember-client-{}-none", std::process::id()));
        let e = Client::new(&path).status().unwrap_err();
        let msg = ember_vmm::error_chain(&e);
        assert_eq!(msg.matches("No such file").count(), 1, "{msg}");
    }
}
