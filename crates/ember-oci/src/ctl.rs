//! The supervisor's control protocol: one request per connection, a JSON
//! line (with descriptors attached, for `exec`), answered by JSON lines.

use crate::fdpass;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
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
pub struct Conn {
    reader: BufReader<UnixStream>,
}

impl Conn {
    /// Sends `req` (with `fds`) to the supervisor at `sock`.
    pub fn send(sock: &Path, req: &Request, fds: &[RawFd]) -> std::io::Result<Conn> {
        let (_dir, short) = crate::state::socket_path(sock)?;
        let s = UnixStream::connect(short)?;
        let mut line = serde_json::to_vec(req).map_err(std::io::Error::other)?;
        line.push(b'\n');
        fdpass::send(s.as_raw_fd(), &line, fds)?;
        Ok(Conn {
            reader: BufReader::new(s),
        })
    }

    /// The next answer; `None` when the supervisor hung up.
    pub fn reply(&mut self, timeout: Option<Duration>) -> std::io::Result<Option<Reply>> {
        self.reader.get_ref().set_read_timeout(timeout)?;
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        serde_json::from_str(&line)
            .map(Some)
            .map_err(std::io::Error::other)
    }

    /// A connection whose request was sent by another process.
    pub fn from_stream(s: UnixStream) -> Conn {
        Conn {
            reader: BufReader::new(s),
        }
    }

    /// The socket, for a relay that waits on it in another process.
    pub fn into_stream(self) -> UnixStream {
        self.reader.into_inner()
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
