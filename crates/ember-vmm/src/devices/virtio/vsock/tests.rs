use std::io::Read;
use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress};

use super::handler::{Handler, RX, TX};
use super::muxer::Muxer;
use super::packet::{HDR_LEN, HOST_CID, Header, TYPE_STREAM, op};
use super::*;
use crate::devices::CountingInterrupt;
use crate::devices::virtio::test_utils::*;

const RXQ: u64 = 0;
const TXQ: u64 = 0x8000;
const EVQ: u64 = 0x1_0000;

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir(name: &str) -> Dir {
    let d = std::env::temp_dir().join(format!("ember-vsockdev-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Dir(d)
}

#[test]
fn the_option_grammar_and_its_errors() {
    let v: VsockConfig = "uds=rel.sock,cid=42".parse().unwrap();
    assert_eq!(v.cid, 42);
    assert!(v.uds.is_absolute());
    for (bad, why) in [
        ("cid=2,uds=/v", "3 to"),
        ("cid=4294967295,uds=/v", "3 to"),
        ("cid=x,uds=/v", "3 to"),
        ("uds=/v", "needs cid"),
        ("cid=3", "needs uds"),
        ("cid=3,uds=/v,port=1", "unknown option"),
    ] {
        let e = bad.parse::<VsockConfig>().unwrap_err().to_string();
        assert!(e.contains(why), "{bad}: {e}");
    }
    let json = serde_json::to_string(&v).unwrap();
    assert_eq!(serde_json::from_str::<VsockConfig>(&json).unwrap(), v);
}

#[test]
fn binding_refuses_a_missing_directory_and_a_live_socket_but_replaces_a_stale_one() {
    let d = dir("bind");
    let cfg = |p: &str| VsockConfig {
        cid: 3,
        uds: d.0.join(p),
    };
    let e = Vsock::new(&cfg("nodir/v.sock")).unwrap_err().to_string();
    assert!(e.contains("does not exist"), "{e}");
    let first = Vsock::new(&cfg("v.sock")).unwrap();
    let e = Vsock::new(&cfg("v.sock")).unwrap_err().to_string();
    assert!(e.contains("in use"), "{e}");
    drop(first);
    // The socket file stays behind; nobody answers on it any more.
    Vsock::new(&cfg("v.sock")).unwrap();
    std::fs::write(d.0.join("file"), b"x").unwrap();
    let e = Vsock::new(&cfg("file")).unwrap_err().to_string();
    assert!(e.contains("not a socket"), "{e}");
    assert!(d.0.join("file").exists());
}

#[test]
fn the_config_space_is_the_cid() {
    let d = dir("cfg");
    let v = Vsock::new(&VsockConfig {
        cid: 0x1234_5678,
        uds: d.0.join("s"),
    })
    .unwrap();
    let mut b = [0u8; 8];
    v.read_config(0, &mut b);
    assert_eq!(u64::from_le_bytes(b), 0x1234_5678);
    assert_eq!(v.device_type(), 19);
    assert_eq!(v.queue_max_sizes().len(), 3);
    assert!(v.holds_buffers(0) && !v.holds_buffers(1) && v.holds_buffers(2));
}

struct Rig<'m> {
    mem: &'m GuestMemory,
    rx: TestQueue<'m>,
    tx: TestQueue<'m>,
    ev: TestQueue<'m>,
    h: Handler,
    irq: Arc<CountingInterrupt>,
    _d: Dir,
    uds: PathBuf,
}

fn rig<'m>(mem: &'m GuestMemory, name: &str, reset_event: bool) -> Rig<'m> {
    let d = dir(name);
    let uds = d.0.join("v.sock");
    let rx = TestQueue::create(mem, GuestAddress(RXQ), 16);
    let tx = TestQueue::create(mem, GuestAddress(TXQ), 16);
    let ev = TestQueue::create(mem, GuestAddress(EVQ), 16);
    let irq = Arc::new(CountingInterrupt::default());
    let m = Muxer::new(3, uds.clone(), bind(&uds).unwrap()).unwrap();
    let h = Handler::new(
        mem.clone(),
        [
            rx.create_queue().unwrap(),
            tx.create_queue().unwrap(),
            ev.create_queue().unwrap(),
        ],
        VirtioInterrupt::new(irq.clone()),
        m,
        reset_event,
    )
    .unwrap();
    Rig {
        mem,
        rx,
        tx,
        ev,
        h,
        irq,
        _d: d,
        uds,
    }
}

fn guest_hdr(op: u16, src: u32, dst: u32, len: u32) -> Header {
    Header {
        src_cid: 3,
        dst_cid: HOST_CID,
        src_port: src,
        dst_port: dst,
        len,
        kind: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 64 * 1024,
        fwd_cnt: 0,
    }
}

impl Rig<'_> {
    /// Queues a packet on tx at descriptor `at` (header and payload in two descriptors).
    fn send(&mut self, at: u16, hdr: &Header, data: &[u8]) {
        let base = DATA_START + u64::from(at) * 0x1000;
        self.mem
            .write_slice(&hdr.encode(), GuestAddress(base))
            .unwrap();
        self.mem
            .write_slice(data, GuestAddress(base + 0x100))
            .unwrap();
        let mut segs = vec![r(base, HDR_LEN as u32)];
        if !data.is_empty() {
            segs.push(r(base + 0x100, data.len() as u32));
        }
        add_chain(&self.tx, at, &segs);
        self.h.process_tx();
    }

    /// Offers a 4 KiB receive buffer at descriptor `at`.
    fn offer(&mut self, at: u16) -> u64 {
        let base = DATA_START + 0x10_0000 + u64::from(at) * 0x2000;
        add_chain(&self.rx, at, &[w(base, 0x1000)]);
        base
    }

    fn read_rx(&self, base: u64) -> (Header, Vec<u8>) {
        let mut b = [0u8; HDR_LEN];
        self.mem.read_slice(&mut b, GuestAddress(base)).unwrap();
        let h = Header::decode(&b);
        let mut data = vec![0u8; h.len as usize];
        self.mem
            .read_slice(&mut data, GuestAddress(base + HDR_LEN as u64))
            .unwrap();
        (h, data)
    }
}

#[test]
fn a_guest_connection_to_a_listening_host_port_carries_data() {
    let mem = memory();
    let mut g = rig(&mem, "flow", false);
    let mut p = g.uds.as_os_str().to_owned();
    p.push("_5000");
    let l = std::os::unix::net::UnixListener::bind(&p).unwrap();
    let b0 = g.offer(0);
    g.send(0, &guest_hdr(op::REQUEST, 1025, 5000, 0), &[]);
    assert_eq!(used(&g.rx), [(0, HDR_LEN as u32)]);
    let (h, _) = g.read_rx(b0);
    assert_eq!(
        (h.op, h.src_cid, h.dst_cid, h.src_port, h.dst_port),
        (op::RESPONSE, 2, 3, 5000, 1025)
    );
    let (mut host, _) = l.accept().unwrap();
    g.send(1, &guest_hdr(op::RW, 1025, 5000, 11), b"hello world");
    let mut got = [0u8; 11];
    host.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hello world");
    assert_eq!(used(&g.tx).len(), 2);
    assert!(g.irq.count() >= 2);
}

#[test]
fn malformed_chains_are_a_device_error_not_a_panic() {
    let mem = memory();
    for case in 0..4 {
        let mut g = rig(&mem, &format!("bad{case}"), false);
        let base = DATA_START;
        match case {
            // A header cut short.
            0 => add_chain(&g.tx, 0, &[r(base, 20)]),
            // A payload length past the chain.
            1 => {
                mem.write_slice(&guest_hdr(op::RW, 1, 2, 4000).encode(), GuestAddress(base))
                    .unwrap();
                add_chain(&g.tx, 0, &[r(base, HDR_LEN as u32), r(base + 0x100, 10)]);
            }
            // A payload longer than any packet.
            2 => {
                mem.write_slice(
                    &guest_hdr(op::RW, 1, 2, 1 << 20).encode(),
                    GuestAddress(base),
                )
                .unwrap();
                add_chain(
                    &g.tx,
                    0,
                    &[r(base, HDR_LEN as u32), r(base + 0x100, 1 << 20)],
                );
            }
            // A transmit buffer the device may only write.
            _ => add_chain(&g.tx, 0, &[w(base, 64)]),
        }
        g.h.process_tx();
        assert!(g.h.broken, "case {case}");
        assert!(g.irq.count() >= 1, "case {case}: the driver is told");
        // Nothing more is served.
        g.offer(0);
        g.send(1, &guest_hdr(op::RW, 1, 2, 0), &[]);
        assert!(used(&g.rx).is_empty(), "case {case}");
    }
    // A read-only receive buffer.
    let mut g = rig(&mem, "badrx", false);
    add_chain(&g.rx, 0, &[r(DATA_START, 0x1000)]);
    g.send(0, &guest_hdr(op::RW, 1, 2, 0), &[]);
    assert!(g.h.broken);
}

#[test]
fn a_restored_device_sends_transport_reset_first() {
    let mem = memory();
    let mut g = rig(&mem, "reset", true);
    g.h.process_event();
    assert!(used(&g.ev).is_empty(), "no buffer yet: it waits");
    add_chain(&g.ev, 0, &[w(DATA_START, 8)]);
    mem.write_obj(0xffff_ffffu32, GuestAddress(DATA_START))
        .unwrap();
    g.h.process_event();
    assert_eq!(used(&g.ev), [(0, 4)]);
    assert_eq!(mem.read_obj::<u32>(GuestAddress(DATA_START)).unwrap(), 0);
    add_chain(&g.ev, 1, &[w(DATA_START, 8)]);
    g.h.process_event();
    assert_eq!(used(&g.ev).len(), 1, "one reset only");
}

#[test]
fn host_data_waits_for_receive_buffers_and_goes_in_order() {
    use std::io::Write;
    let mem = memory();
    let mut g = rig(&mem, "order", false);
    let mut p = g.uds.as_os_str().to_owned();
    p.push("_7");
    let l = std::os::unix::net::UnixListener::bind(&p).unwrap();
    let b = g.offer(0);
    g.send(0, &guest_hdr(op::REQUEST, 9, 7, 0), &[]);
    assert_eq!(g.read_rx(b).0.op, op::RESPONSE);
    let (mut host, _) = l.accept().unwrap();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
    host.write_all(&data).unwrap();
    // The device learns of the data through its epoll; here, by hand.
    let mut evs = [vmm_sys_util::epoll::EpollEvent::default(); 8];
    let n = g.h.muxer.epoll().wait(1000, &mut evs).unwrap();
    for e in &evs[..n] {
        g.h.muxer.event(e.data(), e.event_set());
    }
    g.h.process_rx();
    assert_eq!(used(&g.rx).len(), 1, "no buffer, no read");
    let mut got = Vec::new();
    for i in 1..8u16 {
        let b = g.offer(i);
        g.h.process_rx();
        if used(&g.rx).len() == usize::from(i) + 1 {
            let (h, d) = g.read_rx(b);
            assert_eq!(h.op, op::RW);
            assert!(d.len() <= 0x1000 - HDR_LEN);
            got.extend(d);
        }
    }
    assert_eq!(got, data);
    let _ = (RX, TX);
}
