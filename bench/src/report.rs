//! Writing a run's outputs: `results.json` (the figures, with the commit,
//! configuration and machine they came from), `report.md`, the PNG plots
//! ([`plot`], drawn by the binary), and progress lines while it runs
//! ([`progress`]).

pub mod plot;
pub mod progress;
mod run;

use std::path::Path;

use serde::Serialize;

use crate::error::BenchError;

pub use run::{Machine, RunInfo, write_results};

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

/// Draws the run's plots from `dir/results.json` and returns the report's
/// section linking them (or saying why there are none).
pub fn plots_section(kind: &str, dir: &Path) -> String {
    match plot::draw(kind, dir) {
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
    Machine::detect().to_string()
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
