fn main() {
    let dir = std::path::Path::new(&std::env::args().nth(1).unwrap()).to_path_buf();
    let t = std::time::Instant::now();
    let (s, _) = ember_vmm::snapshot::load_replacing(&dir, &[]).unwrap();
    let first = t.elapsed();
    let t = std::time::Instant::now();
    for _ in 0..50 {
        std::hint::black_box(ember_vmm::snapshot::load_replacing(&dir, &[]).unwrap());
    }
    println!(
        "first {:?} warm {:?} devices {}",
        first,
        t.elapsed() / 50,
        s.devices.len()
    );
    let bytes = std::fs::read(dir.join("state")).unwrap();
    println!("state {} bytes", bytes.len());
}
