//! Token buckets for a direction of traffic, with Firecracker's semantics: a bucket of
//! `size` tokens (bytes, or frames) starts full and refills continuously at `size` per
//! `refill_ms`; a one-time burst is spent first and never refills. A frame larger than
//! the whole bucket passes once the bucket is full and leaves it in debt, so even
//! frames bigger than the bucket keep to the rate over time.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::Error;

/// One bucket as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketConfig {
    /// Tokens the bucket holds (and gets back per `refill_ms`).
    pub size: u64,
    /// Extra tokens available once, at the start.
    #[serde(default)]
    pub one_time_burst: u64,
    /// Milliseconds to refill the whole bucket.
    pub refill_ms: u64,
}

impl BucketConfig {
    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.size == 0 || self.refill_ms == 0 || self.refill_ms > 3_600_000 {
            return Err(Error::BadRate(format!(
                "{}/{}+{}",
                self.size, self.refill_ms, self.one_time_burst
            )));
        }
        Ok(())
    }
}

/// The limits of one direction: bytes, frames, either or both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    /// Bytes (of frames, without the virtio-net header).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<BucketConfig>,
    /// Frames.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ops: Option<BucketConfig>,
}

impl RateLimit {
    /// No limit at all.
    pub fn is_none(&self) -> bool {
        self.bytes.is_none() && self.ops.is_none()
    }
}

#[derive(Debug)]
struct Bucket {
    size: f64,
    /// Tokens per nanosecond.
    rate: f64,
    /// May be negative: the debt of a frame larger than the bucket.
    tokens: f64,
    burst: f64,
    last: Instant,
}

impl Bucket {
    fn new(c: &BucketConfig, now: Instant) -> Self {
        let size = c.size as f64;
        Bucket {
            size,
            rate: size / (c.refill_ms as f64 * 1e6),
            tokens: size,
            burst: c.one_time_burst as f64,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let ns = now.saturating_duration_since(self.last).as_nanos() as f64;
        self.tokens = (self.tokens + ns * self.rate).min(self.size);
        self.last = now;
    }

    /// How long until `n` tokens can be taken (zero: now).
    fn wait(&mut self, n: u64, now: Instant) -> Duration {
        self.refill(now);
        // What the burst does not cover must be in the bucket; a frame larger than
        // the bucket needs it full.
        let need = (n as f64 - self.burst).max(0.0).min(self.size);
        if self.tokens >= need {
            return Duration::ZERO;
        }
        // At least a microsecond, so that a caller re-checking at the deadline finds
        // the tokens there despite rounding.
        Duration::from_nanos(((need - self.tokens) / self.rate).ceil() as u64 + 1000)
    }

    fn take(&mut self, n: u64) {
        let from_burst = self.burst.min(n as f64);
        self.burst -= from_burst;
        self.tokens -= n as f64 - from_burst;
    }
}

/// The buckets of one direction.
#[derive(Debug, Default)]
pub(crate) struct Limiter {
    bytes: Option<Bucket>,
    ops: Option<Bucket>,
}

impl Limiter {
    pub(crate) fn new(limit: &RateLimit) -> Self {
        let now = Instant::now();
        Limiter {
            bytes: limit.bytes.as_ref().map(|c| Bucket::new(c, now)),
            ops: limit.ops.as_ref().map(|c| Bucket::new(c, now)),
        }
    }

    /// Takes the tokens for one frame of `len` bytes, or says how long to wait before
    /// asking again (taking nothing).
    pub(crate) fn consume(&mut self, len: usize) -> Result<(), Duration> {
        if self.bytes.is_none() && self.ops.is_none() {
            // No limit: no clock read (this runs once a frame).
            return Ok(());
        }
        self.consume_at(len, Instant::now())
    }

    fn consume_at(&mut self, len: usize, now: Instant) -> Result<(), Duration> {
        let len = len as u64;
        let wait = [(&mut self.bytes, len), (&mut self.ops, 1)]
            .into_iter()
            .filter_map(|(b, n)| b.as_mut().map(|b| b.wait(n, now)))
            .max()
            .unwrap_or_default();
        if !wait.is_zero() {
            return Err(wait);
        }
        if let Some(b) = &mut self.bytes {
            b.take(len);
        }
        if let Some(b) = &mut self.ops {
            b.take(1);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(size: u64, refill_ms: u64, burst: u64) -> BucketConfig {
        BucketConfig {
            size,
            refill_ms,
            one_time_burst: burst,
        }
    }

    #[test]
    fn a_full_bucket_then_the_rate() {
        let t0 = Instant::now();
        let mut l = Limiter {
            bytes: Some(Bucket::new(&cfg(1000, 100, 0), t0)),
            ops: None,
        };
        assert!(l.consume_at(600, t0).is_ok());
        assert!(l.consume_at(400, t0).is_ok());
        let wait = l.consume_at(100, t0).unwrap_err();
        assert!((Duration::from_millis(10)..Duration::from_millis(11)).contains(&wait));
        assert!(l.consume_at(100, t0 + Duration::from_millis(11)).is_ok());
    }

    #[test]
    fn frames_larger_than_the_bucket_pass_and_leave_debt() {
        let t0 = Instant::now();
        let mut l = Limiter {
            bytes: Some(Bucket::new(&cfg(1000, 1000, 0), t0)),
            ops: None,
        };
        assert!(l.consume_at(3000, t0).is_ok());
        // 2000 of debt and one more frame of 3000 needs a full bucket: 3 s.
        let wait = l.consume_at(3000, t0).unwrap_err();
        assert!(wait >= Duration::from_secs(3) && wait < Duration::from_millis(3001));
    }

    #[test]
    fn the_burst_goes_first_and_ops_count_frames() {
        let t0 = Instant::now();
        let mut l = Limiter {
            bytes: Some(Bucket::new(&cfg(100, 1000, 500), t0)),
            ops: Some(Bucket::new(&cfg(2, 1000, 0), t0)),
        };
        assert!(l.consume_at(550, t0).is_ok());
        assert!(l.consume_at(50, t0).is_ok());
        // Bytes would allow one more, frames not.
        assert!(l.consume_at(1, t0).is_err());
    }

    #[test]
    fn over_seconds_the_rate_is_kept() {
        let t0 = Instant::now();
        let mut l = Limiter::new(&RateLimit {
            bytes: Some(cfg(10_000, 100, 0)),
            ops: None,
        });
        l.bytes.as_mut().unwrap().last = t0;
        let mut now = t0;
        let mut sent = 0u64;
        while now < t0 + Duration::from_secs(4) {
            match l.consume_at(1500, now) {
                Ok(()) => sent += 1500,
                Err(w) => now += w,
            }
        }
        // 100 KB/s for 4 s plus the first full bucket, within a frame.
        let expect = 400_000 + 10_000;
        assert!(sent.abs_diff(expect) <= 1500, "{sent}");
    }
}
