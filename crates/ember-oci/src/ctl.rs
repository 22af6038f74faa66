//! The supervisor's control protocol: one request per connection, a JSON
//! line (with descriptors attached, for `exec`), answered by JSON lines.

use crate::fdpass;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// A request to a container's supervisor.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Boot the VM and set the container up (from `create`, after its hooks).
    Boot {
        /// runc's `--console-socket`, for a terminal.
        console_socket: Option<String>,
    },
    /// Start the container's process.
    Start,
    /// Signal it (or, with `all`, every process of the container).
    Kill {
        /// The signal.
        signal: i32,
        /// All processes.
        all: bool,
    },
    /// Its host processes.
    Pids,
    /// Freeze the VM.
    Pause,
    /// Thaw it.
    Resume,
    /// Run another process (its stdio, or its terminal, attached): answered
    /// once when it starts and again, with its status, when it exits.
    Exec {
        /// The OCI process, as JSON.
        process: String,
    },
    /// New limits for the container's cgroup in the guest.
    Update {
        /// The limits, checked by the client.
        resources: ember_agent::Resources,
    },
    /// The container's figures (its cgroup in the guest).
    Stats,
}

/// An answer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Reply {
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Pids.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pids: Vec<u32>,
    /// A started process's guest pid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// An exited process's status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<i32>,
    /// The container's figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats: Option<ember_agent::Stats>,
}

impl Reply {
    /// A failure.
    pub fn error(e: impl std::fmt::Display) -> Reply {
        Reply {
            error: Some(e.to_string()),
            ..Default::default()
        }
    }
}

/// A client's connection.
///
/// Unbuffered on purpose: `exec --detach` hands the connection to its relay
/// process after the first answer, and the exit status may already have
/// followed it. A buffered reader would take that second line with it and
/// leave the relay an empty socket (which reads as "the supervisor went").
pub struct Conn {
    stream: UnixStream,
}

/// The longest request or answer read (an OCI process, or a `pids` list of
/// a busy container, fits many times over): a peer that sends more is
/// refused, not buffered.
const MAX_LINE: usize = 1 << 20;

impl Conn {
    /// Sends `req` (with `fds`) to the supervisor at `sock`.
    pub fn send(sock: &Path, req: &Request, fds: &[RawFd]) -> std::io::Result<Conn> {
        let (_dir, short) = crate::state::socket_path(sock)?;
        let s = UnixStream::connect(short)?;
        let mut line = serde_json::to_vec(req).map_err(std::io::Error::other)?;
        line.push(b'\n');
        fdpass::send(s.as_raw_fd(), &line, fds)?;
        Ok(Conn { stream: s })
    }

    /// The next answer; `None` when the supervisor hung up. Reads up to its
    /// newline and not a byte beyond.
    pub fn reply(&mut self, timeout: Option<Duration>) -> std::io::Result<Option<Reply>> {
        self.stream.set_read_timeout(timeout)?;
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        loop {
            match self.stream.read(&mut byte) {
                Ok(0) if line.is_empty() => return Ok(None),
                Ok(0) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the supervisor hung up mid-answer",
                    ));
                }
                Ok(_) if byte[0] == b'\n' => break,
                Ok(_) if line.len() >= MAX_LINE => {
                    return Err(std::io::Error::other("the supervisor's answer is too long"));
                }
                Ok(_) => line.push(byte[0]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        serde_json::from_slice(&line)
            .map(Some)
            .map_err(std::io::Error::other)
    }

    /// A connection whose request was sent by another process.
    pub fn from_stream(s: UnixStream) -> Conn {
        Conn { stream: s }
    }

    /// The socket, for a relay that waits on it in another process.
    pub fn into_stream(self) -> UnixStream {
        self.stream
    }
}

/// The server's side of one connection: the request and its descriptors.
pub fn read_request(s: &UnixStream) -> std::io::Result<(Request, Vec<OwnedFd>)> {
    let mut data = Vec::new();
    let mut fds = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    while !data.contains(&b'\n') {
        let (n, more) = fdpass::recv(s.as_raw_fd(), &mut buf)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        data.extend_from_slice(&buf[..n]);
        fds.extend(more);
        if data.len() > MAX_LINE && !data.contains(&b'\n') {
            return Err(std::io::Error::other("the request is too long"));
        }
    }
    let req = serde_json::from_slice(&data).map_err(std::io::Error::other)?;
    Ok((req, fds))
}

/// Writes one answer.
pub fn write_reply(mut s: &UnixStream, r: &Reply) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(r).map_err(std::io::Error::other)?;
    line.push(b'\n');
    s.write_all(&line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_read_leaves_the_next_one_on_the_socket() {
        // exec --detach: the status may follow the first answer at once;
        // the relay that takes the socket over must still find it.
        let (client, server) = UnixStream::pair().unwrap();
        let started = Reply {
            pid: Some(7),
            ..Default::default()
        };
        let exited = Reply {
            status: Some(3),
            ..Default::default()
        };
        write_reply(&server, &started).unwrap();
        write_reply(&server, &exited).unwrap();
        drop(server);
        let mut conn = Conn::from_stream(client);
        assert_eq!(conn.reply(None).unwrap().unwrap().pid, Some(7));
        let mut relay = Conn::from_stream(conn.into_stream());
        assert_eq!(relay.reply(None).unwrap().unwrap().status, Some(3));
        assert!(relay.reply(None).unwrap().is_none());
    }

    #[test]
    fn an_endless_answer_is_refused() {
        let (client, mut server) = UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            let chunk = vec![b'x'; 64 * 1024];
            while server.write_all(&chunk).is_ok() {}
        });
        let e = Conn::from_stream(client).reply(None).unwrap_err();
        assert!(e.to_string().contains("too long"), "{e}");
        writer.join().unwrap();
    }
}
