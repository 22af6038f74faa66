//! The command line's shape, through the binary: `ember boot` (the VMM) and
//! `ember run -- CMD` (the appliance) are separate subcommands, each with its
//! own options; an option one of them does not honour is refused, not dropped.

use std::process::{Command, Output};

fn ember(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        // No kernel or init from the environment: the refusals below must
        // come before the appliance looks for either.
        .env("EMBER_CACHE", "/nonexistent/ember-cli-test")
        .output()
        .expect("ember runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The long options a help text lists.
fn options(help: &str) -> Vec<String> {
    help.split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(|w| w.trim_end_matches([',', '.']).to_owned())
        .collect()
}

#[test]
fn boot_help_lists_the_vmm_options_only() {
    let o = ember(&["boot", "--help"]);
    assert!(o.status.success(), "{}", text(&o));
    let opts = options(&text(&o));
    for want in [
        "--kernel",
        "--initrd",
        "--cmdline",
        "--mem",
        "--cpus",
        "--console",
        "--events",
        "--disk",
        "--pmem",
        "--rng",
        "--balloon",
        "--channel",
        "--no-acpi",
        "--timeout",
    ] {
        assert!(opts.iter().any(|o| o == want), "{want} missing: {opts:?}");
    }
    for appliance_only in [
        "--backend",
        "--machine",
        "--env",
        "--workdir",
        "--rootfs",
        "--prepare-only",
    ] {
        assert!(
            !opts.iter().any(|o| o == appliance_only),
            "{appliance_only} in boot's help"
        );
    }
}

#[test]
fn run_help_lists_the_appliance_options_only() {
    let o = ember(&["run", "--help"]);
    assert!(o.status.success(), "{}", text(&o));
    let help = text(&o);
    let opts = options(&help);
    for want in [
        "--kernel",
        "--cmdline",
        "--mem",
        "--cpus",
        "--disk",
        "--backend",
        "--machine",
        "--timeout",
        "--env",
        "--workdir",
        "--rootfs",
        "--verbose",
        "--prepare-only",
        "--pmem",
        "--rng",
        "--balloon",
        "--events",
        "--no-acpi",
    ] {
        assert!(opts.iter().any(|o| o == want), "{want} missing: {opts:?}");
    }
    for vmm_only in ["--initrd", "--console", "--channel"] {
        assert!(
            !opts.iter().any(|o| o == vmm_only),
            "{vmm_only} in run's help"
        );
    }
    assert!(
        help.contains("[CMD]...") || help.contains("<CMD>..."),
        "{help}"
    );
}

#[test]
fn boot_needs_a_kernel() {
    let o = ember(&["boot"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--kernel"), "{}", text(&o));
}

#[test]
fn run_needs_a_command() {
    let o = ember(&["run", "--mem", "128M"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("CMD"), "{}", text(&o));
}

#[test]
fn run_refuses_vmm_only_options() {
    for (flag, extra) in [
        ("--console", Some("none")),
        ("--initrd", Some("i.cpio")),
        ("--channel", Some("x.sock")),
        ("--hugepages", None),
    ] {
        let mut args = vec!["run", flag];
        args.extend(extra);
        args.extend(["--", "true"]);
        let o = ember(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(
            text(&o).contains(&format!("unexpected argument '{flag}'")),
            "{args:?}: {}",
            text(&o)
        );
    }
}

#[test]
fn run_and_boot_refuse_bad_disks_alike() {
    // One grammar (`DiskConfig`'s `FromStr`), parsed by clap in both.
    for (disk, why) in [
        ("x.img,bogus", "unknown disk option `bogus`"),
        ("x.img,poll=lots", "poll=lots"),
        (",ro", "missing a path"),
    ] {
        let run = ember(&["run", "--disk", disk, "--", "true"]);
        let boot = ember(&["boot", "--kernel", "/nonexistent/k", "--disk", disk]);
        for o in [&run, &boot] {
            assert_eq!(o.status.code(), Some(2), "{disk}: {}", text(o));
            let t = text(o);
            let first = t.lines().next().unwrap_or_default();
            assert!(
                first.contains("invalid value") && first.contains(why),
                "{disk}: {t}"
            );
        }
        assert_eq!(text(&run), text(&boot), "{disk}");
    }
}

#[test]
fn run_refuses_what_the_qemu_backend_cannot_do() {
    for (args, why) in [
        (
            &["--pmem", "/nonexistent/x.img"][..],
            "--pmem /nonexistent/x.img",
        ),
        (&["--machine", "microvm", "--pmem", "x.img"][..], "microvm"),
        (&["--events", "e.json"][..], "--events"),
        (&["--prefault", "async"][..], "--prefault"),
        (&["--disk", "x.img,poll=50"][..], "poll="),
    ] {
        let mut all = vec!["run", "--backend", "qemu"];
        all.extend(args);
        all.extend(["--", "true"]);
        let o = ember(&all);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(125), "{all:?}: {t}");
        assert_eq!(t.lines().count(), 1, "{all:?}: {t}");
        assert!(
            t.contains("qemu backend cannot") && t.contains(why),
            "{all:?}: {t}"
        );
    }
}

#[test]
fn run_refuses_qemu_machine_options_on_the_ember_backend() {
    for args in [&["--machine", "microvm"][..], &["--bios", "seabios"][..]] {
        let mut all = vec!["run", "--backend", "ember"];
        all.extend(args);
        all.extend(["--", "true"]);
        let o = ember(&all);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(125), "{all:?}: {t}");
        assert_eq!(t.lines().count(), 1, "{all:?}: {t}");
        assert!(t.contains("--machine and --bios"), "{all:?}: {t}");
    }
}

#[test]
fn every_disk_option_passes_the_appliance_checks() {
    // With no kernel anywhere the run fails later, at the kernel: the disk
    // options themselves were accepted.
    let o = ember(&[
        "run",
        "--backend",
        "ember",
        "--kernel",
        "/nonexistent/k",
        "--disk",
        "x.img,ro,direct,serial=abc,poll=50",
        "--rng",
        "--balloon",
        "--pmem",
        "p.img",
        "--no-acpi",
        "--",
        "true",
    ]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(125), "{t}");
    assert!(t.contains("/nonexistent/k") && !t.contains("disk"), "{t}");
}

#[test]
fn mem_and_backend_have_one_syntax_everywhere() {
    for sub in ["run", "bench", "analyze"] {
        let mut args = vec![sub, "--mem", "lots"];
        if sub == "run" {
            args.extend(["--", "true"]);
        }
        let o = ember(&args);
        assert_eq!(o.status.code(), Some(2), "{sub}: {}", text(&o));
        assert!(
            text(&o).contains("not a memory size"),
            "{sub}: {}",
            text(&o)
        );
        let help = text(&ember(&[sub, "-h"]));
        assert!(help.contains("[default: 256M]"), "{sub}: {help}");
        assert!(help.contains("[default: auto]"), "{sub}: {help}");
        assert!(
            help.contains("[possible values: auto, ember, qemu]"),
            "{sub}: {help}"
        );
    }
}

/// Every environment variable the sources read (`env::var("X")`,
/// `var_os("X")`, `var("X")` in a closure) outside tests.
fn variables_read() -> Vec<String> {
    let re = regex::Regex::new(r#"var(?:_os)?\(\s*"([A-Z_][A-Z0-9_]*)"\s*\)"#).unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = std::collections::BTreeSet::new();
    let mut dirs = vec![root.join("src"), root.join("crates/ember-vmm/src")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            // Test modules (`tests.rs`, `tests/`) read variables that only
            // the test harness sets.
            let is_tests = p.file_stem().is_some_and(|n| n == "tests");
            if p.is_dir() {
                if !is_tests {
                    dirs.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") && !is_tests {
                let src = std::fs::read_to_string(&p).unwrap();
                // Unit tests sit at the end of a file, after `mod tests`.
                let code = src.split("#[cfg(test)]\nmod tests").next().unwrap();
                found.extend(re.captures_iter(code).map(|c| c[1].to_owned()));
            }
        }
    }
    found.into_iter().collect()
}

#[test]
fn every_environment_variable_is_in_the_help() {
    let vars = variables_read();
    for v in ["EMBER_CACHE", "EMBER_INIT", "EMBER_QEMU"] {
        assert!(
            vars.iter().any(|x| x == v),
            "{v} not found by the scan: {vars:?}"
        );
    }
    for sub in [
        &[][..],
        &["run"],
        &["setup"],
        &["bench"],
        &["analyze"],
        &["bench-range"],
    ] {
        let mut args = sub.to_vec();
        args.push("--help");
        let help = text(&ember(&args));
        for v in &vars {
            assert!(
                help.contains(v),
                "{v} missing from `ember {args:?}`: {help}"
            );
        }
    }
}

#[test]
fn completions_and_man_page_come_from_the_cli() {
    let bash = ember(&["completions", "bash"]);
    assert!(bash.status.success());
    let script = String::from_utf8(bash.stdout).unwrap();
    for want in [
        "_ember()",
        "--kernel",
        "--pmem",
        "bench-range",
        "completions",
    ] {
        assert!(
            script.contains(want),
            "{want} missing from the bash completions"
        );
    }
    let dir = ember_testing::TempDir::new("cli");
    let file = dir.join("ember.bash");
    std::fs::write(&file, &script).unwrap();
    let check = Command::new("bash").arg("-n").arg(&file).output().unwrap();
    assert!(check.status.success(), "bash -n: {}", text(&check));
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let o = ember(&["completions", shell]);
        assert!(o.status.success() && o.stdout.len() > 1000, "{shell}");
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("balloon"),
            "{shell}"
        );
    }
    assert_eq!(ember(&["completions", "tcsh"]).status.code(), Some(2));

    // ember(1): the subcommands as pages of their own, and the environment.
    let man = ember(&["man"]);
    assert!(man.status.success());
    let page = String::from_utf8(man.stdout).unwrap();
    assert!(
        page.starts_with(".ie") || page.starts_with(".TH"),
        "{}",
        &page[..80]
    );
    for want in [
        ".TH ember 1",
        "ember\\-boot(1)",
        "ember\\-run(1)",
        "ember\\-bench\\-range(1)",
        ".SH ENVIRONMENT",
        "EMBER_QEMU",
    ] {
        assert!(page.contains(want), "{want} missing from ember(1)");
    }
    assert!(
        !page.contains("nested"),
        "run's options are on ember-run(1)"
    );

    // ember-SUBCOMMAND(1): that subcommand's options, and no other's.
    let run = text(&ember(&["man", "run"]));
    assert!(run.contains(".TH ember-run 1"), "{run}");
    assert!(run.contains("\\-\\-nested\\-kvm") && run.contains("EMBER_QEMU"));
    assert!(
        !run.contains("balloon\\-target"),
        "boot's option on run's page"
    );
    let boot = text(&ember(&["man", "boot"]));
    assert!(boot.contains(".TH ember-boot 1") && boot.contains("\\-\\-balloon\\-target"));
    assert!(boot.contains("ember boot") && boot.contains("\\fBember\\fR(1)"));
    let bad = ember(&["man", "nosuch"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(
        text(&bad).contains("no subcommand `nosuch`"),
        "{}",
        text(&bad)
    );

    // --dir: every page as a file, each one man(1) can format.
    let pages = dir.join("man");
    let o = ember(&["man", "--dir", pages.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let mut written: Vec<String> = std::fs::read_dir(&pages)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    written.sort();
    let want = [
        "ember-analyze.1",
        "ember-bench-range.1",
        "ember-bench.1",
        "ember-boot.1",
        "ember-completions.1",
        "ember-ctl.1",
        "ember-man.1",
        "ember-run.1",
        "ember-setup.1",
        "ember-snapshot.1",
        "ember.1",
    ];
    assert_eq!(written, want);
    assert_eq!(
        std::fs::read_to_string(pages.join("ember-run.1")).unwrap(),
        run,
        "the file and `ember man run` agree"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
