//! What a run's figures came from, written at the top of its `results.json`:
//! the commit, the configuration (the command line and every resolved
//! option) and the machine.

use std::fmt;
use std::path::Path;
use std::process::Command;

use serde::Serialize;

use crate::error::BenchError;

/// The machine a run measured on.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub cpu_model: String,
    pub ram_bytes: u64,
    /// `PRETTY_NAME` of `/etc/os-release`, and the kernel release.
    pub os: String,
    pub kernel: String,
    pub arch: &'static str,
}

impl Machine {
    pub fn detect() -> Machine {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let field = |text: &str, key: &str, sep: char| {
            text.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_once(sep))
                .map(|(_, v)| v.trim().trim_matches('"').to_owned())
        };
        let kib: u64 = field(&read("/proc/meminfo"), "MemTotal", ':')
            .and_then(|v| v.trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0);
        Machine {
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            cpu_model: field(&read("/proc/cpuinfo"), "model name", ':').unwrap_or_else(|| "unknown CPU".into()),
            ram_bytes: kib * 1024,
            os: field(&read("/etc/os-release"), "PRETTY_NAME", '=').unwrap_or_else(|| std::env::consts::OS.into()),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            arch: std::env::consts::ARCH,
        }
    }
}

impl fmt::Display for Machine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} cores, {}", self.cores, self.cpu_model)?;
        if self.ram_bytes > 0 {
            write!(f, ", {:.1} GiB RAM", self.ram_bytes as f64 / (1u64 << 30) as f64)?;
        }
        write!(f, ", {}", self.os)
    }
}

/// The header of a `results.json`.
#[derive(Clone, Debug, Serialize)]
pub struct RunInfo {
    /// `KVROUTE_COMMIT`, else `git rev-parse HEAD` of the checkout the binary
    /// was built in (`-dirty` with uncommitted changes to tracked files), else
    /// of the current folder, else `unknown`.
    pub commit: String,
    /// The command line as given.
    pub argv: Vec<String>,
    /// Every option as resolved, defaults included (the arguments' `Debug`).
    pub config: String,
    pub machine: Machine,
    pub kvroute_bench_version: &'static str,
    /// Unix time the results were written.
    pub written_at_unix_s: u64,
}

impl RunInfo {
    pub fn new(config: &impl fmt::Debug) -> RunInfo {
        RunInfo {
            commit: commit(),
            argv: std::env::args().collect(),
            config: format!("{config:?}"),
            machine: Machine::detect(),
            kvroute_bench_version: env!("CARGO_PKG_VERSION"),
            written_at_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }
}

/// The commit of the checkout the bench binary was built in (found from the
/// executable's folder, `target/…` inside it), else of the current folder;
/// an environment without git, such as an image, names it in `KVROUTE_COMMIT`.
fn commit() -> String {
    if let Some(c) = std::env::var("KVROUTE_COMMIT").ok().filter(|c| !c.is_empty()) {
        return c;
    }
    let exe_dir = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf));
    let dirs = exe_dir.into_iter().chain(std::env::current_dir().ok());
    dirs.filter_map(|dir| commit_of(&dir)).next().unwrap_or_else(|| "unknown".into())
}

/// `HEAD` of the repository holding `dir`, `-dirty` when tracked files changed.
fn commit_of(dir: &Path) -> Option<String> {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let head = git(&["rev-parse", "HEAD"]).filter(|h| !h.is_empty())?;
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    Some(if dirty { format!("{head}-dirty") } else { head })
}

/// `{"run": RunInfo, "results": results}` to `dir/results.json`.
pub fn write_results(dir: &Path, config: &impl fmt::Debug, results: &impl Serialize) -> Result<(), BenchError> {
    #[derive(Serialize)]
    struct Wrapped<'a, R> {
        run: RunInfo,
        results: &'a R,
    }
    super::write_json(&dir.join("results.json"), &Wrapped { run: RunInfo::new(config), results })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_carry_commit_config_and_machine() {
        let dir = std::env::temp_dir().join(format!("kvroute-run-{}", std::process::id()));
        #[derive(Debug)]
        #[allow(dead_code)]
        struct Args {
            workers: usize,
        }
        write_results(&dir, &Args { workers: 4 }, &vec![1, 2]).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
        assert_eq!(v["results"], serde_json::json!([1, 2]));
        assert_eq!(v["run"]["config"], "Args { workers: 4 }");
        // The test binary lives in this checkout's target folder.
        let commit = v["run"]["commit"].as_str().unwrap();
        assert!(commit.len() >= 40 && commit[..40].chars().all(|c| c.is_ascii_hexdigit()), "{commit}");
        let m = &v["run"]["machine"];
        assert!(m["cores"].as_u64().unwrap() >= 1);
        // Linux: read from /proc.
        assert!(m["ram_bytes"].as_u64().unwrap() > 0, "{m}");
        assert!(!m["cpu_model"].as_str().unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
