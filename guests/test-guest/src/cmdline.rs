//! The command-line language: whitespace-separated tokens, run in order.
//! Tokens whose key isn't ours (`console=ttyS0`, `quiet`) are ignored; a token
//! with our key and a bad value is an error. README.md lists every token.

use crate::virtio_blk::{BlkOpt, Op, Pattern};
use crate::virtio_net::{BadKind, NetCmd, NetOpt};
use crate::virtio_vsock::{Mode as VsockMode, VsockOpt};

/// One of our tokens, parsed.
pub enum Command<'a> {
    /// `print=WORD`: underscores become spaces.
    Print(&'a str),
    /// `mark=N`: a byte to the POST port.
    Mark(u8),
    /// `timer`: the Firecracker boot-timer write.
    Timer,
    /// `touch=MIB`.
    Touch(u64),
    /// `spin=MS`.
    Spin(u64),
    /// `tsc`: print the TSC rate used and its source.
    Tsc,
    /// `exit=N`.
    Exit(u8),
    /// `reset`: i8042 reset.
    Reset,
    /// `shutdown`: ACPI S5.
    Shutdown,
    /// `halt`: stop reading tokens; go to the ending.
    Halt,
    /// A virtio-blk option for later `blk`/`blkverify` runs.
    Blk(BlkOpt),
    /// `blk[=BASE]` (benchmark) or `blkverify[=BASE]` (data check).
    BlkRun { base: Option<u64>, verify: bool },
    /// A virtio-net option for later `net*` commands.
    NetOpt(NetOpt),
    /// A virtio-net command.
    Net(NetCmd),
    /// A virtio-vsock option for later `vsock=` runs.
    Vsock(VsockOpt),
    /// `vsock=serve|connect|malformed|waitreset`.
    VsockRun(VsockMode),
    /// A virtio-mem operation.
    Vmem(VmemOp),
}

/// virtio-mem operations; blocks count from the region's start.
pub enum VmemOp {
    /// `vmem`: print the config space.
    Info,
    /// `vmemplug=B,N`.
    Plug(u64, u64),
    /// `vmemunplug=B,N`.
    Unplug(u64, u64),
    /// `vmemstate=B,N`.
    State(u64, u64),
    /// `vmemunplugall`.
    UnplugAll,
    /// `vmemfill=B,N`: a pattern into every word of the blocks.
    Fill(u64, u64),
    /// `vmemcheck=B,N`: whether the pattern is intact.
    Check(u64, u64),
    /// `vmemwait=SIZE`: until the requested size is SIZE.
    Wait(u64),
    /// `vmemplugreq`: plug blocks up to the requested size.
    PlugToRequested,
    /// `vmemunplugreq`: unplug blocks down to the requested size.
    UnplugToRequested,
}

/// `B,N`.
fn pair(v: &str) -> Result<(u64, u64), &'static str> {
    let (b, n) = v.split_once(',').ok_or("expected BLOCK,COUNT")?;
    Ok((number(b)?, number(n)?))
}

/// Splits a command line into tokens.
pub struct Tokens<'a>(core::str::SplitAsciiWhitespace<'a>);

impl<'a> Tokens<'a> {
    /// Tokens of `cmdline`.
    pub fn new(cmdline: &'a str) -> Self {
        Tokens(cmdline.split_ascii_whitespace())
    }
}

impl<'a> Iterator for Tokens<'a> {
    type Item = &'a str;
    fn next(&mut self) -> Option<&'a str> {
        self.0.next()
    }
}

/// Parses one token: `Ok(None)` if it isn't ours.
pub fn parse(token: &str) -> Result<Option<Command<'_>>, &'static str> {
    let (key, value) = match token.split_once('=') {
        Some((k, v)) => (k, Some(v)),
        None => (token, None),
    };
    let command = match (key, value) {
        ("print", Some(v)) => Command::Print(v),
        ("mark", Some(v)) => Command::Mark(byte(v)?),
        ("timer", None) => Command::Timer,
        ("tsc", None) => Command::Tsc,
        ("touch", Some(v)) => Command::Touch(number(v)?),
        ("spin", Some(v)) => Command::Spin(number(v)?),
        ("exit", Some(v)) => Command::Exit(byte(v)?),
        ("reset", None) => Command::Reset,
        ("shutdown", None) => Command::Shutdown,
        ("halt", None) => Command::Halt,
        ("blk", v) => Command::BlkRun {
            base: v.map(number).transpose()?,
            verify: false,
        },
        ("blkverify", v) => Command::BlkRun {
            base: v.map(number).transpose()?,
            verify: true,
        },
        ("vmem", None) => Command::Vmem(VmemOp::Info),
        ("vmemplug", Some(v)) => Command::Vmem(VmemOp::Plug(pair(v)?.0, pair(v)?.1)),
        ("vmemunplug", Some(v)) => Command::Vmem(VmemOp::Unplug(pair(v)?.0, pair(v)?.1)),
        ("vmemstate", Some(v)) => Command::Vmem(VmemOp::State(pair(v)?.0, pair(v)?.1)),
        ("vmemfill", Some(v)) => Command::Vmem(VmemOp::Fill(pair(v)?.0, pair(v)?.1)),
        ("vmemcheck", Some(v)) => Command::Vmem(VmemOp::Check(pair(v)?.0, pair(v)?.1)),
        ("vmemunplugall", None) => Command::Vmem(VmemOp::UnplugAll),
        ("vmemwait", Some(v)) => Command::Vmem(VmemOp::Wait(number(v)?)),
        ("vmemplugreq", None) => Command::Vmem(VmemOp::PlugToRequested),
        ("vmemunplugreq", None) => Command::Vmem(VmemOp::UnplugToRequested),
        ("blkop", Some(v)) => Command::Blk(BlkOpt::Op(match v {
            "read" => Op::Read,
            "write" => Op::Write,
            "rw" => Op::ReadWrite,
            _ => return Err("expected read, write or rw"),
        })),
        ("pattern", Some(v)) => Command::Blk(BlkOpt::Pattern(match v {
            "seq" => Pattern::Sequential,
            "rand" => Pattern::Random,
            _ => return Err("expected seq or rand"),
        })),
        ("vsock", Some(v)) => Command::VsockRun(match v {
            "serve" => VsockMode::Serve,
            "connect" => VsockMode::Connect,
            "malformed" => VsockMode::Malformed,
            "waitreset" => VsockMode::WaitReset,
            _ => return Err("expected serve, connect, malformed or waitreset"),
        }),
        ("vsockport", Some(v)) => Command::Vsock(VsockOpt::Port(word(v)?)),
        ("vsockbytes", Some(v)) => Command::Vsock(VsockOpt::Bytes(number(v)?)),
        ("vsockbuf", Some(v)) => Command::Vsock(VsockOpt::Buf(word(v)?)),
        ("vsockslow", Some(v)) => Command::Vsock(VsockOpt::SlowUs(number(v)?)),
        ("vsocksecs", Some(v)) => Command::Vsock(VsockOpt::Secs(number(v)?)),
        ("bs", Some(v)) => Command::Blk(BlkOpt::BlockSize(number(v)?)),
        ("qd", Some(v)) => Command::Blk(BlkOpt::QueueDepth(number(v)?)),
        ("blkmib", Some(v)) => Command::Blk(BlkOpt::SpanMib(number(v)?)),
        ("secs", Some(v)) => Command::Blk(BlkOpt::Seconds(number(v)?)),
        ("ios", Some(v)) => Command::Blk(BlkOpt::Ios(number(v)?)),
        ("netoffload", Some(v)) => Command::NetOpt(NetOpt::Offloads(match v {
            "0" => false,
            "1" => true,
            _ => return Err("expected 0 or 1"),
        })),
        ("netevent", Some(v)) => Command::NetOpt(NetOpt::EventIdx(match v {
            "0" => false,
            "1" => true,
            _ => return Err("expected 0 or 1"),
        })),
        ("netlen", Some(v)) => Command::NetOpt(NetOpt::Len(number(v)?)),
        ("netcount", Some(v)) => Command::NetOpt(NetOpt::Count(number(v)?)),
        ("netbytes", Some(v)) => Command::NetOpt(NetOpt::Bytes(number(v)?)),
        ("netsecs", Some(v)) => Command::NetOpt(NetOpt::Secs(number(v)?)),
        ("netinfo", None) => Command::Net(NetCmd::Info),
        ("nettx", None) => Command::Net(NetCmd::Tx),
        ("netrx", None) => Command::Net(NetCmd::Rx),
        ("nettso", Some(v)) => Command::Net(NetCmd::Tso(number(v)?)),
        ("netwatch", Some(v)) => Command::Net(NetCmd::Watch(number(v)?)),
        ("netbad", Some(v)) => Command::Net(NetCmd::Bad(match v {
            "oob" => BadKind::OutOfMemory,
            "write" => BadKind::Writable,
            "long" => BadKind::TooLong,
            _ => return Err("expected oob, write or long"),
        })),
        (
            "print" | "mark" | "touch" | "spin" | "exit" | "blkop" | "pattern" | "bs" | "qd"
            | "blkmib" | "secs" | "ios" | "netoffload" | "netevent" | "netlen" | "netcount"
            | "netbytes" | "netsecs" | "nettso" | "netwatch" | "netbad" | "vsock" | "vsockport"
            | "vsockbytes" | "vsockbuf" | "vsockslow" | "vsocksecs",
            None,
        ) => return Err("needs a value"),
        (
            "timer" | "tsc" | "reset" | "shutdown" | "halt" | "netinfo" | "nettx" | "netrx",
            Some(_),
        ) => return Err("takes no value"),
        _ => return Ok(None),
    };
    Ok(Some(command))
}

/// A number: decimal or `0x` hex, with an optional `k`, `m` or `g` suffix (×1024ⁿ).
pub fn number(text: &str) -> Result<u64, &'static str> {
    let (digits, scale) = match text.as_bytes().last() {
        Some(b'k' | b'K') => (&text[..text.len() - 1], 1 << 10),
        Some(b'm' | b'M') => (&text[..text.len() - 1], 1 << 20),
        Some(b'g' | b'G') => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    let value = match digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => digits.parse(),
    }
    .map_err(|_| "not a number")?;
    value.checked_mul(scale).ok_or("number too large")
}

fn word(text: &str) -> Result<u32, &'static str> {
    u32::try_from(number(text)?).map_err(|_| "must fit in 32 bits")
}

fn byte(text: &str) -> Result<u8, &'static str> {
    u8::try_from(number(text)?).map_err(|_| "must be 0..255")
}
