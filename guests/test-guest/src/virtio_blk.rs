//! A polling virtio-mmio block driver and benchmark (stage 2).

use crate::io::Clock;

/// Which requests a run issues.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    /// Alternating reads and writes.
    ReadWrite,
}

/// Where requests go.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    Sequential,
    Random,
}

/// One option token.
pub enum BlkOpt {
    Op(Op),
    Pattern(Pattern),
    BlockSize(u64),
    QueueDepth(u64),
    SpanMib(u64),
    Seconds(u64),
    Ios(u64),
}

/// Settings for the next run.
pub struct Options {
    pub op: Op,
    pub pattern: Pattern,
    pub block_size: u64,
    pub queue_depth: u64,
    pub span_mib: u64,
    pub seconds: u64,
    pub ios: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            op: Op::Read,
            pattern: Pattern::Sequential,
            block_size: 4096,
            queue_depth: 1,
            span_mib: 0,
            seconds: 0,
            ios: 1000,
        }
    }
}

impl Options {
    /// Applies an option token.
    pub fn set(&mut self, opt: BlkOpt) {
        match opt {
            BlkOpt::Op(op) => self.op = op,
            BlkOpt::Pattern(p) => self.pattern = p,
            BlkOpt::BlockSize(bs) => self.block_size = bs,
            BlkOpt::QueueDepth(qd) => self.queue_depth = qd,
            BlkOpt::SpanMib(mib) => self.span_mib = mib,
            BlkOpt::Seconds(s) => {
                self.seconds = s;
                self.ios = 0;
            }
            BlkOpt::Ios(n) => {
                self.ios = n;
                self.seconds = 0;
            }
        }
    }
}

/// Runs a benchmark or verification on the device at `base` (or the first found).
pub fn run(
    _opts: &Options,
    _base: Option<u64>,
    _verify: bool,
    _clock: &Clock,
) -> Result<(), &'static str> {
    Err("virtio-blk is not implemented yet")
}
