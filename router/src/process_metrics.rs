//! The standard Prometheus process metrics (`process_resident_memory_bytes`,
//! `process_cpu_seconds_total`, `process_open_fds`, `process_threads`,
//! `process_start_time_seconds`), read from `/proc/self` at each scrape.
//!
//! Hand-written because the parsing is a few lines and the crates that do it
//! pull in much more. Where `/proc` is missing (not Linux) nothing is
//! exported: an absent series is honest, a zero would not be.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Linux's `USER_HZ`: the unit of CPU times and start times in
/// `/proc/<pid>/stat`. Fixed at 100 by the kernel ABI on every architecture
/// Linux reports to user space (asking `sysconf` would need `libc`).
const TICKS_PER_SECOND: f64 = 100.0;

/// One reading of this process's figures.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessStats {
    pub resident_bytes: u64,
    pub cpu_seconds: f64,
    pub open_fds: u64,
    pub threads: u64,
    pub start_time_seconds: f64,
}

impl ProcessStats {
    /// Reads `/proc/self`; `None` where it cannot be read.
    pub fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let boot = std::fs::read_to_string("/proc/stat").ok()?;
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
        parse(&stat, &status, &boot, open_fds)
    }
}

/// Builds the figures from `/proc/self/stat`, `/proc/self/status` and
/// `/proc/stat` (for the boot time).
fn parse(stat: &str, status: &str, proc_stat: &str, open_fds: u64) -> Option<ProcessStats> {
    // The command name (field 2) is in parentheses and may hold spaces or
    // parentheses itself: fields are counted from after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `fields[0]` is field 3 (state): field n is `fields[n - 3]`.
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let (utime, stime) = (field(14)?, field(15)?);
    let threads = field(20)?;
    let start_ticks = field(22)?;
    let rss_kib =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.split_whitespace().next()?.parse::<u64>().ok()?;
    let btime = proc_stat.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse::<u64>().ok()?;
    Some(ProcessStats {
        resident_bytes: rss_kib * 1024,
        cpu_seconds: (utime + stime) as f64 / TICKS_PER_SECOND,
        open_fds,
        threads,
        start_time_seconds: btime as f64 + start_ticks as f64 / TICKS_PER_SECOND,
    })
}

/// Exports [`ProcessStats`] read afresh at each scrape.
#[derive(Debug, Default)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = ProcessStats::read() else { return Ok(()) };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges = [
            ("process_resident_memory_bytes", "Resident memory size in bytes", s.resident_bytes as f64),
            ("process_open_fds", "Number of open file descriptors", s.open_fds as f64),
            ("process_threads", "Number of OS threads in the process", s.threads as f64),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                s.start_time_seconds,
            ),
        ];
        for (name, help, value) in gauges {
            let g = ConstGauge::new(value);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files_with_a_command_name_holding_spaces_and_parentheses() {
        let stat = "4242 (kv (route) x) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 50 0 0 20 0 7 0 12345 \
                    100000000 4000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0";
        let status = "Name:\tkvroute\nVmRSS:\t   2048 kB\nThreads:\t7\n";
        let proc_stat = "cpu  1 2 3\nbtime 1700000000\nprocesses 9\n";
        let s = parse(stat, status, proc_stat, 12).unwrap();
        assert_eq!(
            s,
            ProcessStats {
                resident_bytes: 2048 * 1024,
                cpu_seconds: 3.0,
                open_fds: 12,
                threads: 7,
                start_time_seconds: 1_700_000_123.45,
            }
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_this_process() {
        let s = ProcessStats::read().unwrap();
        assert!(s.resident_bytes > 0 && s.threads >= 1 && s.open_fds >= 1, "{s:?}");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        assert!(s.start_time_seconds <= now + 1.0 && s.start_time_seconds > now - 86_400.0 * 365.0, "{s:?}");
    }
}
