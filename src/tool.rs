//! The host tools ember runs for their output (`ip`, `tc`, `git`, `apt-get`,
//! `mkfs.ext4`): one way to run them, so every failure names the command
//! line and gives the tool's own last words, once.

use std::process::Command;

/// A tool that could not run, or ran and failed.
#[derive(Debug, thiserror::Error)]
#[error("`{cmd}` failed: {why}")]
pub struct ToolError {
    /// The command line.
    pub cmd: String,
    /// The last line of its error output, its exit status, or why it did
    /// not run.
    pub why: String,
}

/// Runs `cmd` to its end: its stdout on success.
pub fn run(cmd: &mut Command) -> Result<String, ToolError> {
    let line = command_line(cmd);
    let out = cmd.output().map_err(|e| ToolError {
        cmd: line.clone(),
        why: e.to_string(),
    })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let why = err
            .lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .map_or_else(|| out.status.to_string(), str::to_owned);
        return Err(ToolError { cmd: line, why });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `cmd` as a person would type it (for messages).
pub fn command_line(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stdout_on_success_last_words_on_failure() {
        assert_eq!(
            run(Command::new("sh").args(["-c", "echo out; echo noise >&2"])).unwrap(),
            "out\n"
        );
        let e = run(Command::new("sh").args(["-c", "echo first >&2; echo last >&2; exit 3"]))
            .unwrap_err();
        assert_eq!(e.cmd, "sh -c echo first >&2; echo last >&2; exit 3");
        assert_eq!(e.why, "last");
        let e = run(Command::new("sh").args(["-c", "exit 4"])).unwrap_err();
        assert_eq!(e.why, "exit status: 4");
        let e = run(&mut Command::new("/nonexistent/tool")).unwrap_err();
        assert!(e.why.contains("No such file"), "{e}");
        assert_eq!(
            e.to_string(),
            format!("`/nonexistent/tool` failed: {}", e.why)
        );
    }
}
