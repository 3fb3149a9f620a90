//! Writing a run's outputs: `results.json`, `report.md` and the PNG plots
//! (drawn by `bench/plot.py` with matplotlib when python3 has it; otherwise
//! the command to draw them later is printed).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

use crate::error::BenchError;

pub fn write(path: &Path, contents: &[u8]) -> Result<(), BenchError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| BenchError::Write { path: dir.into(), source })?;
    }
    std::fs::write(path, contents).map_err(|source| BenchError::Write { path: path.into(), source })
}

pub fn write_json(path: &Path, value: &impl Serialize) -> Result<(), BenchError> {
    let text = serde_json::to_vec_pretty(value).unwrap_or_default();
    write(path, &text)
}

/// A Markdown table.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut s = format!("| {} |\n|{}\n", header.join(" | "), "---|".repeat(header.len()));
    for r in rows {
        s.push_str(&format!("| {} |\n", r.join(" | ")));
    }
    s
}

/// The plotting script: beside the crate's manifest when built from the repo.
fn plot_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("plot.py")
}

/// Runs `plot.py KIND DIR`; returns the PNGs it wrote, or a note on how to
/// draw them by hand.
pub fn plot(kind: &str, dir: &Path) -> Result<Vec<String>, String> {
    let script = plot_script();
    let hint = format!("python3 -m pip install matplotlib && python3 {} {kind} {}", script.display(), dir.display());
    if !script.is_file() {
        return Err(format!("plot script not found; draw the plots with: {hint}"));
    }
    let has_mpl = Command::new("python3").args(["-c", "import matplotlib"]).output().is_ok_and(|o| o.status.success());
    if !has_mpl {
        return Err(format!("python3 with matplotlib not available; draw the plots with: {hint}"));
    }
    match Command::new("python3").arg(&script).arg(kind).arg(dir).output() {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).collect()),
        Ok(o) => Err(format!("plot.py failed: {}", String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => Err(format!("cannot run python3: {e}")),
    }
}

/// Appends the plot images (or the note on how to draw them) to a report.
pub fn plots_section(kind: &str, dir: &Path) -> String {
    match plot(kind, dir) {
        Ok(files) if !files.is_empty() => {
            let mut s = String::from("\n## Plots\n\n");
            for f in files {
                s.push_str(&format!("![{f}]({f})\n\n"));
            }
            s
        }
        Ok(_) => String::new(),
        Err(note) => {
            eprintln!("{note}");
            format!("\n## Plots\n\n{note}\n")
        }
    }
}

/// Machine facts for a report's header.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores, {cpu}")
}

pub fn ms(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_table() {
        let t = table(&["a", "b"], &[vec!["1".into(), "2".into()]]);
        assert_eq!(t, "| a | b |\n|---|---|\n| 1 | 2 |\n");
    }
}
