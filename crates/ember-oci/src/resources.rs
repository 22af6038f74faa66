//! `update`'s input (runc's `--resources` JSON, or its flags) checked and
//! turned into the guest agent's limits, and `events`' figures (the
//! container's cgroup in the guest) in runc's JSON shape.

use ember::container::ContainerError;
use ember::container::spec::{CpuResources, LinuxResources, MemoryResources, PidsResources};
use ember_agent::{Resources, Stats};

/// Why an update cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum ResourcesError {
    /// A flag's value does not parse.
    #[error("--{flag} {value:?}: {why}")]
    Flag {
        /// The flag.
        flag: &'static str,
        /// What it was given.
        value: String,
        /// Why it is refused.
        why: &'static str,
    },
    /// A limit below -1 (-1 means none, as with runc).
    #[error("{what} is {value}: give a positive number, or -1 for no limit")]
    Negative {
        /// Which field.
        what: &'static str,
        /// Its value.
        value: i64,
    },
    /// A value the guest's cgroup would refuse.
    #[error("{0}")]
    Range(String),
    /// The JSON does not parse, or asks for what a VM cannot do.
    #[error(transparent)]
    Container(#[from] ContainerError),
}

/// runc's `update` flags, as given.
#[derive(Debug, Clone, Default)]
pub struct Flags {
    /// `--memory`.
    pub memory: Option<String>,
    /// `--memory-swap`.
    pub memory_swap: Option<String>,
    /// `--cpu-quota`.
    pub cpu_quota: Option<String>,
    /// `--cpu-period`.
    pub cpu_period: Option<String>,
    /// `--cpu-share` (runc's name; `--cpu-shares` too).
    pub cpu_shares: Option<String>,
    /// `--pids-limit`.
    pub pids_limit: Option<String>,
}

impl Flags {
    /// Whether any flag was given.
    pub fn any(&self) -> bool {
        [
            &self.memory,
            &self.memory_swap,
            &self.cpu_quota,
            &self.cpu_period,
            &self.cpu_shares,
            &self.pids_limit,
        ]
        .iter()
        .any(|f| f.is_some())
    }

    /// The resources the flags ask for.
    pub fn to_resources(&self) -> Result<LinuxResources, ResourcesError> {
        let memory = |flag, v: &Option<String>| v.as_deref().map(|v| bytes(flag, v)).transpose();
        let int = |flag, v: &Option<String>| {
            v.as_deref()
                .map(|v| {
                    v.trim().parse::<i64>().map_err(|_| ResourcesError::Flag {
                        flag,
                        value: v.to_owned(),
                        why: "not a whole number",
                    })
                })
                .transpose()
        };
        let unsigned = |flag, v: &Option<String>| {
            v.as_deref()
                .map(|v| {
                    v.trim().parse::<u64>().map_err(|_| ResourcesError::Flag {
                        flag,
                        value: v.to_owned(),
                        why: "not a whole number of at least 0",
                    })
                })
                .transpose()
        };
        Ok(LinuxResources {
            memory: Some(MemoryResources {
                limit: memory("memory", &self.memory)?,
                swap: memory("memory-swap", &self.memory_swap)?,
            }),
            cpu: Some(CpuResources {
                quota: int("cpu-quota", &self.cpu_quota)?,
                period: unsigned("cpu-period", &self.cpu_period)?,
                shares: unsigned("cpu-share", &self.cpu_shares)?,
                ..Default::default()
            }),
            pids: int("pids-limit", &self.pids_limit)?.map(|limit| PidsResources { limit }),
            ..Default::default()
        })
    }
}

/// A size as runc takes it: bytes, or with a unit (`200m`, `1.5G`,
/// `64KiB`: powers of 1024); `-1` is no limit.
pub fn bytes(flag: &'static str, value: &str) -> Result<i64, ResourcesError> {
    let bad = |why| ResourcesError::Flag {
        flag,
        value: value.to_owned(),
        why,
    };
    let v = value.trim();
    if v == "-1" {
        return Ok(-1);
    }
    if v.starts_with('-') {
        return Err(bad("a size below 0 (-1 alone means no limit)"));
    }
    let lower = v.to_ascii_lowercase();
    let digits = lower
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(lower.len());
    let (number, unit) = lower.split_at(digits);
    let shift = match unit.trim() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => return Err(bad("not a size (a number, then b, k, m, g, t or p)")),
    };
    let n: f64 = number
        .parse()
        .map_err(|_| bad("not a size (a number, then b, k, m, g, t or p)"))?;
    let b = n * (1u64 << shift) as f64;
    if !b.is_finite() || b >= i64::MAX as f64 {
        return Err(bad("too large"));
    }
    Ok(b as i64)
}

/// The agent's limits for `r`, checked: what a guest's cgroup v2 would
/// refuse is refused here, in words.
pub fn to_agent(r: &LinuxResources) -> Result<Resources, ResourcesError> {
    let at_least_minus_one = |what, v: Option<i64>| match v {
        Some(v) if v < -1 => Err(ResourcesError::Negative { what, value: v }),
        _ => Ok(()),
    };
    let memory = r.memory.clone().unwrap_or_default();
    let cpu = r.cpu.clone().unwrap_or_default();
    at_least_minus_one("memory.limit", memory.limit)?;
    at_least_minus_one("memory.swap", memory.swap)?;
    at_least_minus_one("cpu.quota", cpu.quota)?;
    at_least_minus_one("pids.limit", r.pids.as_ref().map(|p| p.limit))?;
    if let (Some(l), Some(s)) = (memory.limit, memory.swap)
        && l > 0
        && s > 0
        && s < l
    {
        return Err(ResourcesError::Range(format!(
            "memory.swap ({s}) is memory and swap together: it cannot be below memory.limit ({l})"
        )));
    }
    // cgroup v2's cpu.max bounds (the kernel's EINVAL, said here).
    if let Some(p) = cpu.period.filter(|&p| p != 0)
        && !(1_000..=1_000_000).contains(&p)
    {
        return Err(ResourcesError::Range(format!(
            "cpu.period {p} µs: it must be 1000 to 1000000"
        )));
    }
    if let Some(q) = cpu.quota.filter(|&q| q > 0 && q < 1_000) {
        return Err(ResourcesError::Range(format!(
            "cpu.quota {q} µs: it must be at least 1000 (or -1 for none)"
        )));
    }
    Ok(r.to_agent()?)
}

/// Refuses a memory limit above the VM's memory: the container's cgroup
/// lives in the VM, which cannot grow while it runs.
pub fn fits_vm(r: &Resources, vm_mib: u64) -> Result<(), ResourcesError> {
    match r.memory_limit {
        Some(l) if l > 0 && (l as u64).div_ceil(1 << 20) > vm_mib => {
            Err(ResourcesError::Range(format!(
                "a memory limit of {} MiB is more than the container's VM has ({vm_mib} MiB): \
                 a running VM does not grow; recreate the container with the limit it needs",
                (l as u64).div_ceil(1 << 20)
            )))
        }
        _ => Ok(()),
    }
}

/// A `runc events` record of the container's figures (its cgroup in the
/// guest), times in nanoseconds as runc gives them.
pub fn event(id: &str, s: &Stats) -> serde_json::Value {
    let [
        usage_usec,
        user_usec,
        system_usec,
        nr_periods,
        nr_throttled,
        throttled_usec,
    ] = s.cpu;
    let [_low, _high, max, _oom, _oom_kill] = s.memory_events;
    let raw: serde_json::Map<String, serde_json::Value> = s
        .memory_stat
        .iter()
        .map(|(k, v)| (k.clone(), (*v).into()))
        .collect();
    let file = s
        .memory_stat
        .iter()
        .find(|(k, _)| k == "file")
        .map_or(0, |(_, v)| *v);
    serde_json::json!({
        "type": "stats",
        "id": id,
        "data": {
            "cpu": {
                "usage": {
                    "total": usage_usec * 1000,
                    "kernel": system_usec * 1000,
                    "user": user_usec * 1000,
                },
                "throttling": {
                    "periods": nr_periods,
                    "throttledPeriods": nr_throttled,
                    "throttledTime": throttled_usec * 1000,
                },
            },
            "memory": {
                "cache": file,
                "usage": {"limit": s.memory_limit, "usage": s.memory_usage, "failcnt": max},
                "raw": raw,
            },
            "pids": {"current": s.pids_current, "limit": s.pids_limit},
            "blkio": {},
            "hugetlb": {},
            "intel_rdt": {},
            "network_interfaces": null,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_runc_takes_them() {
        assert_eq!(bytes("memory", "200m").unwrap(), 200 << 20);
        assert_eq!(bytes("memory", "1.5G").unwrap(), 3 << 29);
        assert_eq!(bytes("memory", "64KiB").unwrap(), 64 << 10);
        assert_eq!(bytes("memory", "4096").unwrap(), 4096);
        assert_eq!(bytes("memory", "-1").unwrap(), -1);
        for bad in ["-5m", "", "m", "12x", "1..2g", "1e400"] {
            let e = bytes("memory", bad).unwrap_err().to_string();
            assert!(e.starts_with(&format!("--memory {bad:?}: ")), "{bad}: {e}");
        }
    }

    #[test]
    fn flags_become_limits() {
        let f = Flags {
            memory: Some("200m".into()),
            memory_swap: Some("-1".into()),
            cpu_quota: Some("50000".into()),
            cpu_period: Some("100000".into()),
            cpu_shares: Some("512".into()),
            pids_limit: Some("64".into()),
        };
        assert!(f.any() && !Flags::default().any());
        let a = to_agent(&f.to_resources().unwrap()).unwrap();
        assert_eq!(a.memory_limit, Some(200 << 20));
        assert_eq!(a.memory_swap, Some(-1));
        assert_eq!((a.cpu_quota, a.cpu_period), (Some(50_000), Some(100_000)));
        assert_eq!((a.cpu_shares, a.pids_limit), (Some(512), Some(64)));
        // Flags not given leave their limits as they are.
        let a = to_agent(
            &Flags {
                cpu_quota: Some("-1".into()),
                ..Default::default()
            }
            .to_resources()
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            (a.memory_limit, a.cpu_quota, a.pids_limit),
            (None, Some(-1), None)
        );
        let e = Flags {
            cpu_period: Some("-3".into()),
            ..Default::default()
        }
        .to_resources()
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "--cpu-period \"-3\": not a whole number of at least 0"
        );
    }

    /// What `docker update --memory 200m --cpus 1` sends through
    /// containerd's runc shim (`runc update --resources -`).
    const DOCKER_UPDATE: &str = r#"{"memory":{"limit":209715200},
        "cpu":{"quota":100000,"period":100000},"blockIO":{},"pids":null}"#;

    #[test]
    fn dockers_update_becomes_limits() {
        let r = LinuxResources::parse(DOCKER_UPDATE.as_bytes()).unwrap();
        let a = to_agent(&r).unwrap();
        assert_eq!(a.memory_limit, Some(200 << 20));
        assert_eq!((a.cpu_quota, a.cpu_period), (Some(100_000), Some(100_000)));
        assert_eq!(
            (a.memory_swap, a.cpu_shares, a.pids_limit),
            (None, None, None)
        );
    }

    #[test]
    fn bad_resources_are_refused_in_words() {
        let refused = |json: &str| match LinuxResources::parse(json.as_bytes()) {
            Ok(r) => to_agent(&r).unwrap_err().to_string(),
            Err(e) => e.to_string(),
        };
        assert!(refused("{\"memory\": ").starts_with("resources: "));
        assert!(refused("[1]").starts_with("resources: invalid type"));
        assert_eq!(
            refused(r#"{"memory": {"limit": -200}}"#),
            "memory.limit is -200: give a positive number, or -1 for no limit"
        );
        assert!(
            refused(r#"{"cpu": {"shares": -2}}"#).contains("invalid value: integer `-2`"),
            "{}",
            refused(r#"{"cpu": {"shares": -2}}"#)
        );
        assert_eq!(
            refused(r#"{"pids": {"limit": -7}}"#),
            "pids.limit is -7: give a positive number, or -1 for no limit"
        );
        assert!(refused(r#"{"memory": {"limit": 1000, "swap": 10}}"#).contains("below"));
        assert!(refused(r#"{"cpu": {"period": 10}}"#).contains("1000 to 1000000"));
        assert!(refused(r#"{"cpu": {"quota": 5}}"#).contains("at least 1000"));
        assert!(refused(r#"{"cpu": {"cpus": "0-1"}}"#).starts_with("not implemented: cpusets"));
    }

    #[test]
    fn a_limit_beyond_the_vm_is_refused() {
        let limit = |l| Resources {
            memory_limit: Some(l),
            ..Default::default()
        };
        assert!(fits_vm(&limit(200 << 20), 556).is_ok());
        assert!(fits_vm(&limit(556 << 20), 556).is_ok());
        assert!(fits_vm(&limit(-1), 556).is_ok());
        assert!(fits_vm(&Resources::default(), 556).is_ok());
        let e = fits_vm(&limit(1 << 30), 556).unwrap_err().to_string();
        assert!(
            e.starts_with(
                "a memory limit of 1024 MiB is more than the container's VM has (556 MiB)"
            ),
            "{e}"
        );
    }

    #[test]
    fn figures_take_runcs_shape() {
        let s = Stats {
            cpu: [2_000, 1_500, 500, 10, 3, 7],
            memory_usage: 12 << 20,
            memory_limit: 200 << 20,
            memory_stat: vec![("anon".into(), 8 << 20), ("file".into(), 4 << 20)],
            memory_events: [0, 0, 2, 1, 1],
            pids_current: 3,
            pids_limit: 0,
        };
        let e = event("c1", &s);
        assert_eq!(e["type"], "stats");
        assert_eq!(e["id"], "c1");
        let d = &e["data"];
        assert_eq!(d["cpu"]["usage"]["total"], 2_000_000);
        assert_eq!(d["cpu"]["usage"]["user"], 1_500_000);
        assert_eq!(d["cpu"]["usage"]["kernel"], 500_000);
        assert_eq!(d["cpu"]["throttling"]["throttledTime"], 7_000);
        assert_eq!(d["memory"]["usage"]["usage"], 12u64 << 20);
        assert_eq!(d["memory"]["usage"]["limit"], 200u64 << 20);
        assert_eq!(d["memory"]["usage"]["failcnt"], 2);
        assert_eq!(d["memory"]["cache"], 4u64 << 20);
        assert_eq!(d["memory"]["raw"]["anon"], 8u64 << 20);
        assert_eq!(d["pids"]["current"], 3);
    }
}
