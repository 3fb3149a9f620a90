//! Logging set-up shared by both binaries: one environment variable for the
//! level (`KVROUTE_LOG`), one for the format (`KVROUTE_LOG_FORMAT`), each
//! overridden by its flag (`--log-level`, `--log-format`).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    #[error("log level {0:?}: {1}")]
    Level(String, String),
    #[error("log format {0:?} is not `text` or `json`")]
    Format(String),
}

/// Where log lines go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    Stdout,
    Stderr,
}

/// Installs the global subscriber. `level` and `format` are the flags;
/// absent, the environment decides, then `info` and `text`. Text is coloured
/// only on a terminal, so redirected logs stay plain.
pub fn init(level: Option<&str>, format: Option<&str>, output: Output) -> Result<(), LoggingError> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    // The sidecar once read RUST_LOG: still honoured when KVROUTE_LOG is unset.
    let level = level.map(str::to_owned).or_else(|| env("KVROUTE_LOG")).or_else(|| env("RUST_LOG"));
    let level = level.unwrap_or_else(|| "info".into());
    let filter = EnvFilter::try_new(&level).map_err(|e| LoggingError::Level(level.clone(), e.to_string()))?;
    let format = format.map(str::to_owned).or_else(|| env("KVROUTE_LOG_FORMAT")).unwrap_or_else(|| "text".into());
    let terminal = match output {
        Output::Stdout => std::io::stdout().is_terminal(),
        Output::Stderr => std::io::stderr().is_terminal(),
    };
    let writer = move || -> Box<dyn std::io::Write> {
        match output {
            Output::Stdout => Box::new(std::io::stdout()),
            Output::Stderr => Box::new(std::io::stderr()),
        }
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer);
    match format.as_str() {
        "text" => builder.with_ansi(terminal).init(),
        "json" => builder.json().with_current_span(false).init(),
        _ => return Err(LoggingError::Format(format)),
    }
    Ok(())
}

/// An error with every cause, `a: b: c`: reqwest's top level alone says only
/// "error sending request", and the cause is what an operator needs.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
