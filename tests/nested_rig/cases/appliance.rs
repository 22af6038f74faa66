//! `ember run` (the appliance) on the ember backend, in L2.

use crate::rig::rig;

#[test]
fn appliance_on_the_ember_backend_keeps_streams_and_status() {
    let r = rig();
    let c = r.case("appliance");
    assert_eq!(c.rc, Some(7), "exit status\n{}", c.dump());
    assert_eq!(
        c.out,
        [r.version.as_str()],
        "stdout: the guest kernel's release\n{}",
        c.dump()
    );
    assert_eq!(c.err, ["err"], "stderr kept apart\n{}", c.dump());
}

#[test]
fn appliance_console_carries_stdin_and_stdout() {
    let r = rig();
    let c = r.case("console");
    assert_eq!(c.rc, Some(0), "{}", c.dump());
    assert_eq!(c.out, [format!("stdin-{}", r.token)], "{}", c.dump());
}
