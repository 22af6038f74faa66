//! The control socket: `ember boot … --api-socket PATH` serves requests on a
//! unix socket, one JSON object per line, one reply line each:
//!
//! ```text
//! {"op":"status"}                      {"ok":true,"state":"running","vcpus":1,"mem_bytes":...}
//! {"op":"pause"}                       {"ok":true}
//! {"op":"resume"}                      {"ok":true}
//! {"op":"snapshot","dir":"/abs/path"}  {"ok":true,"memory_bytes":...,"state_bytes":...,"ms":...}
//! {"op":"shutdown"}                    {"ok":true,"shutdown":true}
//! {"op":"balloon","target_mib":64}     {"ok":true}
//! {"op":"balloon_stats"}               {"ok":true,"target_pages":...,"actual_pages":...,"stats":{...}}
//! {"op":"mem","size_mib":2048}         {"ok":true,"boot_bytes":...,"requested_bytes":...,"plugged_bytes":...}
//! anything else                        {"ok":false,"error":"…"}
//! ```
//!
//! The server ([`server`]) and the one client ([`client`], used by `ember
//! ctl`, `ember snapshot` and the appliance) share the types here: a
//! [`Request`], and a [`Response`] written by [`encode`] and read by
//! [`decode`]. The reply's first byte goes out as soon as the request is
//! read, so a client can tell a VM that does not answer from a long snapshot.

pub mod client;
mod commands;
mod server;

pub use client::{Client, ClientError, call};
pub use commands::{CtlArgs, CtlOp, SnapshotArgs, ctl, snapshot};
pub use server::{ApiContext, ApiError, ApiSocket, handle, request_limit};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A request. Every variant has braces, even without fields: serde
/// refuses unknown fields only in struct variants.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Running or paused, and the VM's shape.
    Status {},
    /// Stop every vCPU.
    Pause {},
    /// Let them run again.
    Resume {},
    /// Write a snapshot of the paused VM to `dir`.
    Snapshot {
        /// An absolute directory path.
        dir: PathBuf,
    },
    /// End the VM (ember exits with status 0).
    Shutdown {},
    /// Set the balloon's target size.
    Balloon {
        /// How much memory the balloon should take from the guest.
        target_mib: u64,
    },
    /// The balloon's target, size and the guest's last statistics.
    BalloonStats {},
    /// The virtio-mem region: resize it (the guest's memory, boot RAM
    /// included, becomes `size_mib`) and report it.
    Mem {
        /// The guest's memory in MiB, boot RAM and plugged memory together;
        /// none: only report.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        size_mib: Option<u64>,
    },
}

/// Whether the VM's vCPUs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    /// vCPUs run the guest.
    Running,
    /// Every vCPU is parked.
    Paused,
}

/// The answer to [`Request::Status`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// Running or paused.
    pub state: VmState,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest memory, bytes.
    pub mem_bytes: u64,
    /// Devices.
    pub devices: usize,
    /// Whether it has a balloon.
    pub balloon: bool,
}

/// The answer to [`Request::Snapshot`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotWritten {
    /// Bytes of guest memory written.
    pub memory_bytes: u64,
    /// The state file's size.
    pub state_bytes: u64,
    /// Device requests drained before the snapshot was taken.
    pub in_flight: u32,
    /// Wall time of the whole snapshot.
    pub ms: f64,
}

/// The answer to [`Request::BalloonStats`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BalloonReport {
    /// The target, in 4 KiB pages.
    pub target_pages: u32,
    /// What the guest's driver says it holds.
    pub actual_pages: u32,
    /// Pages given back to the host.
    pub discarded_pages: u64,
    /// ember's own count of what the balloon holds.
    pub held_pages: u64,
    /// The guest's last statistics, tag number → value.
    pub stats: Option<BTreeMap<String, u64>>,
}

/// The answer to [`Request::Mem`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemReport {
    /// The boot RAM, bytes.
    pub boot_bytes: u64,
    /// The virtio-mem region, bytes.
    pub region_bytes: u64,
    /// What the user asks of the region.
    pub user_requested_bytes: u64,
    /// What the driver is asked for (no more than is committed).
    pub requested_bytes: u64,
    /// What the driver has plugged.
    pub plugged_bytes: u64,
    /// Unplugged memory given back to the host so far.
    pub discarded_bytes: u64,
}

/// A request's answer when the VM did it.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// Done; nothing to say.
    Done,
    /// Shutting down once the reply is out.
    ShutDown,
    /// See [`Status`].
    Status(Status),
    /// See [`SnapshotWritten`].
    Snapshot(SnapshotWritten),
    /// See [`BalloonReport`].
    Balloon(BalloonReport),
    /// See [`MemReport`].
    Mem(MemReport),
}

/// A reply line: the answer, or why the VM refused.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Done; the answer.
    Answer(Response),
    /// Refused; the VM's reason.
    Refused(String),
}

/// A reply that did not parse as the answer to its request.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadReply(String);

/// The reply line (without its newline) for `reply`: `{"ok":true,…}` with
/// the answer's fields, or `{"ok":false,"error":…}`. Keys in sorted order.
pub fn encode(reply: &Reply) -> String {
    let fields = |v: Result<Value, serde_json::Error>| match v {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    };
    let mut m = match reply {
        Reply::Answer(Response::Done) => Map::new(),
        Reply::Answer(Response::ShutDown) => {
            Map::from_iter([("shutdown".into(), Value::Bool(true))])
        }
        Reply::Answer(Response::Status(s)) => fields(serde_json::to_value(s)),
        Reply::Answer(Response::Snapshot(s)) => fields(serde_json::to_value(s)),
        Reply::Answer(Response::Balloon(b)) => fields(serde_json::to_value(b)),
        Reply::Answer(Response::Mem(m)) => fields(serde_json::to_value(m)),
        Reply::Refused(why) => Map::from_iter([("error".into(), Value::String(why.clone()))]),
    };
    m.insert("ok".into(), Value::Bool(matches!(reply, Reply::Answer(_))));
    Value::Object(m).to_string()
}

/// Reads `line` as the reply to `req`.
pub fn decode(req: &Request, line: &str) -> Result<Reply, BadReply> {
    let v: Value = serde_json::from_str(line).map_err(|e| BadReply(e.to_string()))?;
    match v.get("ok") {
        Some(Value::Bool(true)) => {}
        Some(Value::Bool(false)) => {
            let why = v.get("error").and_then(Value::as_str).unwrap_or("refused");
            return Ok(Reply::Refused(why.to_owned()));
        }
        _ => return Err(BadReply("no \"ok\"".into())),
    }
    fn parse<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, BadReply> {
        serde_json::from_value(v).map_err(|e| BadReply(e.to_string()))
    }
    Ok(Reply::Answer(match req {
        Request::Status {} => Response::Status(parse(v)?),
        Request::Snapshot { .. } => Response::Snapshot(parse(v)?),
        Request::BalloonStats {} => Response::Balloon(parse(v)?),
        Request::Mem { .. } => Response::Mem(parse(v)?),
        Request::Shutdown {} => Response::ShutDown,
        Request::Pause {} | Request::Resume {} | Request::Balloon { .. } => Response::Done,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the server writes, the client reads back as the same answer.
    #[test]
    fn replies_round_trip() {
        let status = Response::Status(Status {
            state: VmState::Paused,
            vcpus: 2,
            mem_bytes: 64 << 20,
            devices: 3,
            balloon: false,
        });
        let line = encode(&Reply::Answer(status.clone()));
        assert_eq!(
            line,
            r#"{"balloon":false,"devices":3,"mem_bytes":67108864,"ok":true,"state":"paused","vcpus":2}"#
        );
        assert_eq!(
            decode(&Request::Status {}, &line).unwrap(),
            Reply::Answer(status)
        );
        let written = Response::Snapshot(SnapshotWritten {
            memory_bytes: 1,
            state_bytes: 2,
            in_flight: 0,
            ms: 1.5,
        });
        let req = Request::Snapshot { dir: "/s".into() };
        assert_eq!(
            decode(&req, &encode(&Reply::Answer(written.clone()))).unwrap(),
            Reply::Answer(written)
        );
        let shut = encode(&Reply::Answer(Response::ShutDown));
        assert_eq!(shut, r#"{"ok":true,"shutdown":true}"#);
        assert_eq!(
            decode(&Request::Shutdown {}, &shut).unwrap(),
            Reply::Answer(Response::ShutDown)
        );
        let no = encode(&Reply::Refused("already paused".into()));
        assert_eq!(no, r#"{"error":"already paused","ok":false}"#);
        assert_eq!(
            decode(&Request::Pause {}, &no).unwrap(),
            Reply::Refused("already paused".into())
        );
        assert!(decode(&Request::Status {}, r#"{"ok":true}"#).is_err());
        assert!(decode(&Request::Pause {}, "nonsense").is_err());
    }

    /// Requests go out as the server reads them.
    #[test]
    fn requests_are_one_object_tagged_by_op() {
        let r = Request::Balloon { target_mib: 4 };
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(line, r#"{"op":"balloon","target_mib":4}"#);
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
        assert_eq!(
            serde_json::to_string(&Request::BalloonStats {}).unwrap(),
            r#"{"op":"balloon_stats"}"#
        );
    }
}
