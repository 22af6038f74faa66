//! `ember ctl` and `ember snapshot`: the control socket's client on the
//! command line.

use super::{Client, ClientError, Reply, Request, Response, encode};
use anyhow::Context;
use std::path::PathBuf;

/// Arguments of `ember ctl`.
#[derive(Debug, clap::Args)]
pub struct CtlArgs {
    /// The VM's control socket (`ember boot … --api-socket PATH`).
    #[arg(long, value_name = "PATH")]
    pub api_socket: PathBuf,
    /// What to ask.
    #[arg(value_enum)]
    pub op: CtlOp,
    /// For `balloon`: the balloon's target size in MiB.
    #[arg(long, required_if_eq("op", "balloon"))]
    pub target_mib: Option<u64>,
    /// For `mem`: the guest's memory, boot RAM and virtio-mem together
    /// (e.g. 2G); without it, `mem` only reports.
    #[arg(long, value_name = "SIZE")]
    pub size: Option<String>,
}

/// `ember ctl` requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CtlOp {
    /// Running or paused, and the VM's shape.
    Status,
    /// Stop the vCPUs.
    Pause,
    /// Let them run again.
    Resume,
    /// End the VM.
    Shutdown,
    /// Set the balloon's target (--target-mib).
    Balloon,
    /// The balloon's size and the guest's memory statistics.
    BalloonStats,
    /// The virtio-mem region: resize it (--size) and report it.
    Mem,
}

/// `ember ctl`: one request, its reply printed as JSON; exit status 1 when
/// the VM refused it.
pub fn ctl(args: CtlArgs) -> anyhow::Result<i32> {
    let request = match args.op {
        CtlOp::Status => Request::Status {},
        CtlOp::Pause => Request::Pause {},
        CtlOp::Resume => Request::Resume {},
        CtlOp::Shutdown => Request::Shutdown {},
        CtlOp::Balloon => Request::Balloon {
            target_mib: args.target_mib.unwrap_or(0),
        },
        CtlOp::BalloonStats => Request::BalloonStats {},
        CtlOp::Mem => Request::Mem {
            size_mib: match &args.size {
                Some(s) => Some(ember_vmm::vstate::memory::parse_size(s)? >> 20),
                None => None,
            },
        },
    };
    let reply = match Client::new(&args.api_socket).send(&request) {
        Err(ClientError::Refused(why)) => Reply::Refused(why),
        r => Reply::Answer(r?),
    };
    println!("{}", encode(&reply));
    Ok(if matches!(reply, Reply::Answer(_)) {
        0
    } else {
        1
    })
}

/// Arguments of `ember snapshot`.
#[derive(Debug, clap::Args)]
pub struct SnapshotArgs {
    /// The VM's control socket (`ember boot … --api-socket PATH`).
    #[arg(long, value_name = "PATH")]
    pub api_socket: PathBuf,
    /// Write the snapshot into this directory (created if needed).
    #[arg(long, value_name = "DIR")]
    pub to: PathBuf,
    /// Let the VM run on afterwards (by default it ends once saved).
    #[arg(long)]
    pub resume: bool,
}

/// `ember snapshot`: pauses the VM (if it runs), writes the snapshot, then
/// ends the VM or, with `--resume`, lets it run on. If the snapshot fails,
/// a VM this command paused runs on as before.
pub fn snapshot(args: SnapshotArgs) -> anyhow::Result<i32> {
    let dir = std::path::absolute(&args.to)?;
    let vm = Client::new(&args.api_socket);
    let paused_here = vm.status()?.state == super::VmState::Running;
    if paused_here {
        vm.pause().context("cannot pause")?;
    }
    let written = match vm.snapshot(&dir) {
        Ok(w) => w,
        Err(e) => {
            if paused_here {
                let _ = vm.resume();
            }
            return Err(e.into());
        }
    };
    if !args.resume {
        vm.shutdown().context("snapshot written, but")?;
    } else if paused_here {
        vm.resume().context("snapshot written, but")?;
    }
    println!("{}", encode(&Reply::Answer(Response::Snapshot(written))));
    Ok(0)
}
