use super::*;
use crate::devices::CountingInterrupt;
use crate::devices::virtio::test_utils::*;
use vm_memory::GuestAddress;

#[test]
fn the_option_grammar_and_its_one_line_errors() {
    let fs: FsConfig = "tag=src,dir=/srv/src".parse().unwrap();
    assert_eq!(fs, FsConfig::new("src", "/srv/src", false).unwrap());
    let ro: FsConfig = "dir=rel,tag=t,ro".parse().unwrap();
    assert!(ro.read_only && ro.dir.is_absolute());
    for (bad, says) in [
        ("dir=/x", "needs tag"),
        ("tag=x", "needs dir"),
        ("tag=,dir=/x", "needs tag"),
        ("tag=x,dir=/x,rw", "unknown --fs option"),
        (
            "tag=0123456789012345678901234567890123456,dir=/x",
            "longer than 36",
        ),
    ] {
        let e = bad.parse::<FsConfig>().unwrap_err().to_string();
        assert!(e.contains(says), "{bad}: {e}");
        assert!(!e.contains('\n'));
    }
    let two = ["tag=a,dir=/x", "tag=a,dir=/y"].map(|s| s.parse().unwrap());
    let e = FsConfig::check_tags(&two).unwrap_err().to_string();
    assert_eq!(e, "fs tag \"a\" is used twice");
    let e = Fs::new(&"tag=a,dir=/nonexistent/dir".parse().unwrap())
        .unwrap_err()
        .to_string();
    assert_eq!(e, "cannot share /nonexistent/dir");
    let json = serde_json::to_string(&fs).unwrap();
    assert_eq!(json, r#"{"tag":"src","dir":"/srv/src","read_only":false}"#);
}

#[test]
fn the_config_space_holds_the_tag_and_one_request_queue() {
    let dev = Fs::new(&FsConfig::new("share", "/", true).unwrap()).unwrap();
    assert_eq!(dev.device_type(), 26);
    assert_eq!(dev.queue_max_sizes().len(), 2);
    let mut cfg = [0xffu8; 40];
    dev.read_config(0, &mut cfg);
    assert_eq!(&cfg[..5], b"share");
    assert!(cfg[5..36].iter().all(|&b| b == 0));
    assert_eq!(&cfg[36..], &1u32.to_le_bytes());
}

const REQ: u64 = DATA_START;
const REPLY: u64 = DATA_START + 0x1000;

fn handler(mem: &GuestMemory, dir: &std::path::Path, vq: &TestQueue) -> FsHandler {
    let hiprio = TestQueue::create(mem, GuestAddress(0x8_0000), 16);
    FsHandler {
        mem: mem.clone(),
        queues: vec![hiprio.create_queue().unwrap(), vq.create_queue().unwrap()],
        irq: VirtioInterrupt::new(Arc::new(CountingInterrupt::default())),
        server: FsHandle(Arc::new(Mutex::new(Server::new(dir, false).unwrap()))),
        buffers: Buffers::default(),
    }
}

fn request(mem: &GuestMemory, opcode: u32, nodeid: u64, arg: &[u8]) -> u32 {
    let h = abi::InHeader {
        len: (40 + arg.len()) as u32,
        opcode,
        unique: 42,
        nodeid,
        ..Default::default()
    };
    let mut bytes = h.as_bytes().to_vec();
    bytes.extend_from_slice(arg);
    mem.write_slice(&bytes, GuestAddress(REQ)).unwrap();
    bytes.len() as u32
}

#[test]
fn a_request_chain_gets_its_reply_split_over_the_buffers() {
    let mem = memory();
    let vq = TestQueue::new(&mem, 16);
    let dir = std::env::temp_dir();
    let mut h = handler(&mem, &dir, &vq);
    let init = abi::InitIn {
        major: 7,
        minor: 31,
        ..Default::default()
    };
    let len = request(&mem, abi::INIT, 0, init.as_bytes());
    // The reply lands in two buffers: 10 bytes, then the rest.
    add_chain(&vq, 0, &[r(REQ, len), w(REPLY, 10), w(REPLY + 0x100, 200)]);
    h.process_queue(1);
    assert_eq!(used(&vq), [(0, 16 + 64)]);
    let mut out = [0u8; 80];
    mem.read_slice(&mut out[..10], GuestAddress(REPLY)).unwrap();
    mem.read_slice(&mut out[10..], GuestAddress(REPLY + 0x100))
        .unwrap();
    let (hdr, rest) = abi::OutHeader::read_from_prefix(&out).unwrap();
    assert_eq!((hdr.len, hdr.error, hdr.unique), (80, 0, 42));
    assert_eq!(abi::InitOut::read_from_prefix(rest).unwrap().0.minor, 31);

    // An error is a header alone.
    let len = request(&mem, abi::GETATTR, 12345, &[]);
    add_chain(&vq, 3, &[r(REQ, len), w(REPLY, 200)]);
    h.process_queue(1);
    assert_eq!(used(&vq)[1], (3, 16));
    let mut raw = [0u8; 16];
    mem.read_slice(&mut raw, GuestAddress(REPLY)).unwrap();
    let hdr = abi::OutHeader::read_from_bytes(&raw).unwrap();
    assert_eq!(hdr.error, -libc::ESTALE);
}

#[test]
fn guest_garbage_is_a_device_error_not_a_panic() {
    let mem = memory();
    let vq = TestQueue::new(&mem, 16);
    let dir = std::env::temp_dir();
    let mut h = handler(&mem, &dir, &vq);
    let len = request(&mem, abi::GETATTR, 1, &[]);
    // No header; readable after writable; outside memory; no reply room.
    add_chain(&vq, 0, &[r(REQ, 8), w(REPLY, 100)]);
    add_chain(&vq, 2, &[w(REPLY, 100), r(REQ, len)]);
    add_chain(&vq, 4, &[r(1 << 40, len), w(REPLY, 100)]);
    add_chain(&vq, 6, &[r(REQ, len), w(REPLY, 8)]);
    add_chain(&vq, 8, &[r(REQ, len), w(1 << 40, 200)]);
    h.process_queue(1);
    assert_eq!(used(&vq), [(0, 0), (2, 0), (4, 0), (6, 0), (8, 0)]);
    // A request larger than any FUSE request is not read in whole.
    let segs: Vec<_> = (0..300).map(|_| r(REQ, 0x10_000)).collect();
    add_indirect_chain(&vq, 10, DATA_START + 0x10_0000, &segs);
    h.process_queue(1);
    assert_eq!(used(&vq)[5], (10, 0));
    assert!(h.buffers.request.capacity() <= MAX_REQUEST + 0x10_000);
}
