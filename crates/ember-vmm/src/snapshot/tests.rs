//! The state file: round trips, and every kind of damage refused without a
//! panic.

use super::*;
use crate::devices::virtio::mmio::{QueueRegs, TransportState};
use crate::devices::virtio::{BalloonConfig, DiskConfig, PmemConfig};
use kvm_bindings::{kvm_irqchip, kvm_msr_entry};

fn sample() -> SnapshotState {
    let chip = |id| kvm_irqchip {
        chip_id: id,
        ..Default::default()
    };
    SnapshotState {
        ember_version: "test".into(),
        mem_size: 64 << 20,
        host_cpuid: vec![kvm_cpuid_entry2 {
            function: 0,
            eax: 0x10,
            ..Default::default()
        }],
        vcpus: vec![sample_vcpu()],
        vm: vm::VmState {
            pic_master: chip(0),
            pic_slave: chip(1),
            ioapic: chip(2),
            pit: Default::default(),
            clock: kvm_bindings::kvm_clock_data {
                clock: 987_654_321,
                ..Default::default()
            },
        },
        serial: SerialState {
            baud_divisor_low: 12,
            baud_divisor_high: 0,
            interrupt_enable: 1,
            interrupt_identification: 1,
            line_control: 3,
            line_status: 0x60,
            modem_control: 8,
            modem_status: 0xb0,
            scratch: 0,
            in_buffer: b"ls\n".to_vec(),
        },
        devices: vec![sample_disk()],
        vmgenid: true,
        memory_checksum: None,
    }
}

/// [`sample`]'s vCPU.
fn sample_vcpu() -> vcpu::VcpuState {
    let regs = kvm_bindings::kvm_regs {
        rip: 0x10_0040,
        rax: 0xdead_beef,
        ..Default::default()
    };
    let mut xsave = kvm_bindings::kvm_xsave::default();
    xsave.region[7] = 0x1234_5678;
    let mut lapic = kvm_bindings::kvm_lapic_state::default();
    lapic.regs[0x350] = 7;
    vcpu::VcpuState {
        id: 0,
        cpuid: vec![kvm_cpuid_entry2 {
            function: 1,
            eax: 0x800f12,
            ..Default::default()
        }],
        tsc_khz: Some(2_250_000),
        mp_state: Default::default(),
        regs,
        sregs: Default::default(),
        xsave,
        xcrs: Default::default(),
        debugregs: Default::default(),
        lapic,
        msrs: vec![kvm_msr_entry {
            index: 0x10,
            data: 12345,
            ..Default::default()
        }],
        events: Default::default(),
    }
}

/// [`sample`]'s one device: a disk, its driver ready.
fn sample_disk() -> DeviceState {
    DeviceState {
        config: DeviceConfig::Block(DiskConfig {
            path: "/tmp/disk.img".into(),
            read_only: false,
            direct: false,
            serial: Some("d0".into()),
            poll_us: Some(50),
        }),
        placement: Placement::default(),
        file: Some(FileIdentity {
            dev: 1,
            ino: 2,
            size: 4096,
            mtime_ns: 3,
        }),
        transport: TransportState {
            device_type: 2,
            status: 15,
            device_features_sel: 1,
            driver_features_sel: 0,
            driver_features: 1 << 32,
            queue_sel: 0,
            active: true,
            interrupt_status: 1,
            needs_reset: false,
            queues: vec![QueueRegs {
                size: 256,
                ready: true,
                desc: 0x80_0000,
                avail: 0x80_1000,
                used: 0x80_2000,
            }],
        },
        balloon: None,
        hotplug: None,
        fs: None,
    }
}

/// [`sample`] with a balloon as its second device.
fn with_balloon() -> SnapshotState {
    let mut s = sample();
    let mut transport = s.devices[0].transport.clone();
    transport.device_type = 5;
    s.devices.push(DeviceState {
        config: DeviceConfig::Balloon(BalloonConfig::default()),
        placement: Placement::default(),
        file: None,
        transport,
        balloon: Some(BalloonState {
            reporting: false,
            user_pages: 300,
            fence_pages: 4000,
            actual_pages: 3990,
            generation: 7,
            held: vec![(0x10_0000, 0x20_0000), (0x300_0000, 0x301_0000)],
            discarded_pages: 12,
            inflated_pages: 5000,
            deflated_pages: 1010,
            stats: Some(vec![(4, 1 << 20), (5, 64 << 20)]),
            held_stats: Some(2),
        }),
        hotplug: None,
        fs: None,
    });
    s
}

#[test]
fn a_balloon_round_trips() {
    let s = with_balloon();
    let bytes = encode(&s);
    let back = decode(&bytes, path()).unwrap();
    assert_eq!(encode(&back), bytes);
    assert_eq!(back.devices[1].balloon, s.devices[1].balloon);
    assert_eq!(
        back.devices[1].config,
        DeviceConfig::Balloon(BalloonConfig::default())
    );
    // A state file without balloons has no `balloon` field in its devices.
    let plain = String::from_utf8_lossy(&encode(&sample())[24..]).into_owned();
    assert!(!plain.contains("balloon"), "{plain}");
}

#[test]
fn a_forged_balloon_state_is_refused() {
    let forge = |f: fn(&mut BalloonState)| {
        let mut s = with_balloon();
        f(s.devices[1].balloon.as_mut().unwrap());
        encode(&s)
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "beyond RAM",
            forge(|b| b.held.push((64 << 20, (64 << 20) + 4096))),
        ),
        ("unaligned", forge(|b| b.held[0].0 += 1)),
        ("empty range", forge(|b| b.held[0].1 = b.held[0].0)),
        ("out of order", forge(|b| b.held.reverse())),
        ("overflowing", forge(|b| b.held.push((u64::MAX - 4095, 0)))),
        ("stats head", forge(|b| b.held_stats = Some(256))),
        (
            "stats",
            forge(|b| b.stats = Some(vec![(0, 0); MAX_BALLOON_STATS_IN_TEST])),
        ),
        (
            "no state",
            reencode(|s| {
                s.devices[0].config = DeviceConfig::Balloon(BalloonConfig::default());
                s.devices[0].file = None;
            }),
        ),
        (
            "state on a disk",
            encode(&{
                let mut s = with_balloon();
                s.devices[0].balloon = s.devices[1].balloon.clone();
                s
            }),
        ),
    ];
    for (what, bytes) in cases {
        match decode(&bytes, path()) {
            Err(SnapshotError::Invalid { why, .. }) => eprintln!("{what}: {why}"),
            other => panic!("{what}: {other:?}"),
        }
    }
    assert!(decode(&encode(&with_balloon()), path()).is_ok());
}

/// More statistics than one 64 KiB buffer holds.
const MAX_BALLOON_STATS_IN_TEST: usize = 64 * 1024 / 10 + 1;

fn path() -> &'static Path {
    Path::new("state")
}

/// Re-encodes a state with a valid header, for damage a checksum cannot see.
fn reencode(f: impl FnOnce(&mut SnapshotState)) -> Vec<u8> {
    let mut s = sample();
    f(&mut s);
    encode(&s)
}

#[test]
fn state_file_round_trips_every_field() {
    let s = sample();
    let bytes = encode(&s);
    let back = decode(&bytes, path()).unwrap();
    // Re-encoding what was decoded gives the same bytes: every field came back.
    assert_eq!(encode(&back), bytes);
    assert_eq!(back.vcpus[0].regs.rip, 0x10_0040);
    assert_eq!(back.vcpus[0].xsave.region[7], 0x1234_5678);
    assert_eq!(back.vcpus[0].lapic.regs[0x350], 7);
    assert_eq!(back.vcpus[0].msrs[0].data, 12345);
    assert_eq!(back.vm.clock.clock, 987_654_321);
    assert_eq!(back.serial, s.serial);
    assert_eq!(back.devices[0].transport, s.devices[0].transport);
    assert_eq!(back.devices[0].config, s.devices[0].config);
    assert!(back.vmgenid);
}

/// A state written before the VM generation ID existed (no `vmgenid`
/// field) still loads, as a guest without one.
#[test]
fn a_state_without_the_vmgenid_field_is_a_guest_without_one() {
    let mut json: serde_json::Value = serde_json::to_value(sample()).unwrap();
    json.as_object_mut().unwrap().remove("vmgenid").unwrap();
    let payload = serde_json::to_vec(&json).unwrap();
    let mut bytes = encode(&sample())[..24].to_vec();
    bytes[12..20].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes[20..24].copy_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&payload);
    assert!(!decode(&bytes, path()).unwrap().vmgenid);
}

#[test]
fn every_truncation_is_refused() {
    let bytes = encode(&sample());
    for len in 0..bytes.len() {
        let e = decode(&bytes[..len], path()).unwrap_err();
        assert!(matches!(e, SnapshotError::Truncated(_)), "{len} bytes: {e}");
    }
}

/// A state file larger than any ember writes is refused before it is read:
/// a damaged or hostile one cannot make ember allocate its size.
#[test]
fn a_huge_state_file_is_refused_unread() {
    let dir = ember_testing::TempDir::new("snap-huge");
    let f = std::fs::File::create(dir.join(STATE_FILE)).unwrap();
    // Sparse: 100 GiB long, nothing written.
    f.set_len(100 << 30).unwrap();
    let e = load(&dir, || Ok(Vec::new())).unwrap_err();
    assert!(
        matches!(e, SnapshotError::TooLarge { size, .. } if size == 100 << 30),
        "{e}"
    );
    assert!(e.to_string().contains("ember writes at most"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_flipped_byte_is_refused() {
    let bytes = encode(&sample());
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0x20;
        let e = decode(&b, path());
        assert!(e.is_err(), "byte {i} flipped was accepted");
    }
}

#[test]
fn wrong_magic_version_and_trailing_data_are_refused() {
    let bytes = encode(&sample());
    let mut b = bytes.clone();
    b[0] = b'X';
    assert!(matches!(
        decode(&b, path()),
        Err(SnapshotError::NotASnapshot(_))
    ));
    let mut b = bytes.clone();
    b[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    let e = decode(&b, path()).unwrap_err();
    assert!(matches!(e, SnapshotError::Version { found, .. } if found == FORMAT_VERSION + 1));
    assert!(e.to_string().contains("version"), "{e}");
    let mut b = bytes.clone();
    b.push(b'\n');
    assert!(matches!(
        decode(&b, path()),
        Err(SnapshotError::TrailingData(_))
    ));
    // A length that claims more than the file holds.
    let mut b = bytes;
    b[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        decode(&b, path()),
        Err(SnapshotError::Truncated(_))
    ));
}

#[test]
fn a_checksummed_payload_that_makes_no_sense_is_refused() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("no vcpus", reencode(|s| s.vcpus.clear())),
        ("vcpu ids", reencode(|s| s.vcpus[0].id = 3)),
        ("tiny memory", reencode(|s| s.mem_size = 4096)),
        ("odd memory", reencode(|s| s.mem_size = (64 << 20) + 1)),
        ("chips", reencode(|s| s.vm.pic_slave.chip_id = 2)),
        ("fifo", reencode(|s| s.serial.in_buffer = vec![0; 65])),
        ("file", reencode(|s| s.devices[0].file = None)),
        (
            "a region on a disk",
            reencode(|s| s.devices[0].placement.region = Some(1 << 32)),
        ),
        (
            "too many devices",
            reencode(|s| {
                let d = s.devices[0].clone();
                s.devices = vec![d; layout::VIRTIO_MMIO_MAX_DEVICES + 1];
            }),
        ),
        (
            "msrs",
            reencode(|s| s.vcpus[0].msrs = vec![Default::default(); MAX_MSRS + 1]),
        ),
    ];
    for (what, bytes) in cases {
        match decode(&bytes, path()) {
            Err(SnapshotError::Invalid { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// Payloads that pass the checksum but are garbage: random bytes, JSON of
/// the wrong shape, the real payload cut short or with a field renamed.
#[test]
fn garbage_with_a_valid_checksum_is_refused_without_panicking() {
    let with_header = |payload: &[u8]| {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        out.extend_from_slice(payload);
        out
    };
    let real = serde_json::to_vec(&sample()).unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut payloads: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"null".to_vec(),
        b"[]".to_vec(),
        b"{}".to_vec(),
        String::from_utf8_lossy(&real)
            .replace("\"mem_size\"", "\"mem_sise\"")
            .into_bytes(),
        String::from_utf8_lossy(&real)
            .replace("\"regs\":[", "\"regs\":[999,")
            .into_bytes(),
    ];
    for cut in (0..real.len()).step_by(97) {
        payloads.push(real[..cut].to_vec());
    }
    for _ in 0..200 {
        let len = (rand() % 512) as usize;
        payloads.push((0..len).map(|_| rand() as u8).collect());
        // The real payload with a few bytes replaced.
        let mut p = real.clone();
        for _ in 0..3 {
            let i = (rand() as usize) % p.len();
            p[i] = rand() as u8;
        }
        payloads.push(p);
    }
    for p in payloads {
        let r = decode(&with_header(&p), path());
        // Replacing bytes can leave valid JSON (a digit for a digit): that
        // decodes, but never panics.
        if let Err(e) = r {
            assert!(!e.to_string().contains('\n'), "one line: {e}");
        }
    }
}

/// The leaf a failed CPUID comparison names.
fn cpu_why(r: Result<(), SnapshotError>) -> String {
    match r {
        Err(SnapshotError::Cpu(why)) => why,
        other => panic!("not a CPU mismatch: {other:?}"),
    }
}

#[test]
fn cpuid_comparison_names_the_leaf() {
    let a = vec![
        kvm_cpuid_entry2 {
            function: 7,
            ebx: 1,
            ..Default::default()
        },
        kvm_cpuid_entry2 {
            function: 1,
            ..Default::default()
        },
    ];
    assert!(compare_cpuid(&a, &a).is_ok());
    // The APIC id of the host CPU that ran the query is not a feature.
    let mut moved = a.clone();
    moved[1].ebx = 3 << 24;
    assert!(compare_cpuid(&a, &moved).is_ok());
    moved[1].ebx |= 1;
    assert_eq!(cpu_why(compare_cpuid(&a, &moved)), "leaf 0x1.0 differs");
    let mut b = a.clone();
    b[0].ebx = 3;
    assert_eq!(cpu_why(compare_cpuid(&a, &b)), "leaf 0x7.0 differs");
    assert_eq!(
        cpu_why(compare_cpuid(&a, &b[1..])),
        "leaf 0x7.0 is missing here"
    );
    assert_eq!(
        cpu_why(compare_cpuid(&a[1..], &a)),
        "leaf 0x7.0 is new here"
    );
}

#[test]
fn load_refuses_wrong_memory_size_other_cpus_and_changed_files() {
    let dir = ember_testing::TempDir::new("snapload");
    let disk = dir.join("disk.img");
    std::fs::write(&disk, vec![0u8; 4096]).unwrap();
    let mut s = sample();
    let DeviceConfig::Block(d) = &mut s.devices[0].config else {
        unreachable!()
    };
    d.path.clone_from(&disk);
    s.devices[0].file = Some(FileIdentity::of(&disk).unwrap());
    std::fs::write(dir.join(STATE_FILE), encode(&s)).unwrap();
    let mem = std::fs::File::create(dir.join(MEMORY_FILE)).unwrap();
    mem.set_len(s.mem_size).unwrap();
    let cpu = s.host_cpuid.clone();
    load(&dir, || Ok(cpu.clone())).unwrap();

    // Another CPU.
    let mut other = cpu.clone();
    other[0].eax += 1;
    let e = load(&dir, || Ok(other.clone())).unwrap_err();
    assert!(matches!(e, SnapshotError::Cpu(_)), "{e}");
    // Memory of the wrong size.
    mem.set_len(s.mem_size - 4096).unwrap();
    let e = load(&dir, || Ok(cpu.clone())).unwrap_err();
    assert!(matches!(e, SnapshotError::MemorySize { .. }), "{e}");
    mem.set_len(s.mem_size).unwrap();
    // The disk grew, then was replaced by another file.
    std::fs::write(&disk, vec![0u8; 8192]).unwrap();
    let e = load(&dir, || Ok(cpu.clone())).unwrap_err();
    assert!(e.to_string().contains("changed size"), "{e}");
    std::fs::remove_file(&disk).unwrap();
    std::fs::write(dir.join("other"), vec![0u8; 4096]).unwrap();
    std::fs::rename(dir.join("other"), &disk).unwrap();
    let e = load(&dir, || Ok(cpu.clone())).unwrap_err();
    assert!(matches!(e, SnapshotError::FileChanged { .. }), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The appliance backs its pmem slot with each run's own image: a file of
/// the recorded size replaces the recorded one; any other size, or more
/// files than pmem devices, is refused.
#[test]
fn pmem_backing_files_are_replaced_only_by_files_of_the_same_size() {
    let dir = ember_testing::TempDir::new("snap-pmem");
    let file = |name: &str, len: u64| {
        let p = dir.join(name);
        std::fs::File::create(&p).unwrap().set_len(len).unwrap();
        p
    };
    let (old, same, small) = (
        file("old.img", 2 << 20),
        file("same.img", 2 << 20),
        file("small.img", 1 << 20),
    );
    let mut s = sample();
    s.devices.push(DeviceState {
        config: DeviceConfig::Pmem(PmemConfig { path: old.clone() }),
        placement: Placement {
            region: Some(1 << 32),
        },
        file: Some(FileIdentity::of(&old).unwrap()),
        transport: s.devices[0].transport.clone(),
        balloon: None,
        hotplug: None,
        fs: None,
    });
    let mut replaced = decode(&encode(&s), path()).unwrap();
    replace_pmem(&mut replaced, std::slice::from_ref(&same)).unwrap();
    let d = &replaced.devices[1];
    assert_eq!(d.config.path(), Some(same.as_path()));
    assert_eq!(d.file, Some(FileIdentity::of(&same).unwrap()));
    // The disk before it is untouched.
    assert_eq!(replaced.devices[0].config, s.devices[0].config);

    let mut t = decode(&encode(&s), path()).unwrap();
    let e = replace_pmem(&mut t, &[small]).unwrap_err().to_string();
    assert!(e.contains("1048576 bytes") && !e.contains('\n'), "{e}");
    let mut t = decode(&encode(&s), path()).unwrap();
    let e = replace_pmem(&mut t, &[same.clone(), same]).unwrap_err();
    assert!(e.to_string().contains("fewer pmem devices"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The CPU signature a snapshot records reads the same on every CPU of this
/// host (what differs between CPUs, their APIC ids, is left out of the
/// comparison), and a changed feature bit is another CPU.
#[test]
fn the_cpu_signature_is_the_same_on_every_cpu_of_a_host() {
    use crate::arch::x86_64::cpuid::host_signature;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let on_cpu = |cpu: usize| {
        std::thread::spawn(move || {
            // SAFETY: a zeroed cpu_set_t is valid; CPU_SET and
            // sched_setaffinity only read and write it and this thread.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
            host_signature()
        })
        .join()
        .unwrap()
    };
    let first = on_cpu(0);
    assert!(
        first.iter().any(|e| e.function == 0 && e.ebx != 0),
        "{first:?}"
    );
    assert!(first.iter().any(|e| e.function == 0x7 && e.index == 0));
    for cpu in 1..cpus {
        compare_cpuid(&first, &on_cpu(cpu)).unwrap();
    }
    let mut other = first.clone();
    let features = other.iter_mut().find(|e| e.function == 0x1).unwrap();
    features.ecx ^= 1 << 28; // AVX
    assert!(cpu_why(compare_cpuid(&first, &other)).contains("leaf 0x1.0 differs"));
}
