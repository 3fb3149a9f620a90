//! kvroute-sidecar binary: flags, config file and `KVROUTE_SIDECAR_*` env into a
//! validated config, telemetry, bind, then [`kvroute_sidecar::run`].

use anyhow::Context;
use clap::Parser;
use kvroute_sidecar::RawConfig;
use kvroute_sidecar::cli::Cli;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut cli = Cli::parse();
    // Before anything slow: a stop asked for meanwhile is kept, not lost.
    let stop = kvroute_serve::signals::stop_requested().context("installing the signal handlers")?;
    // Logs go to stderr: tools read the "listening on" line from stdout.
    kvroute_shared::logging::init(
        cli.log_level.as_deref(),
        cli.log_format.as_deref(),
        kvroute_shared::logging::Output::Stderr,
    )?;
    let mut layers = config::Config::builder();
    if let Some(path) = cli.config.take() {
        layers = layers.add_source(config::File::from(path).format(config::FileFormat::Toml));
    }
    let lower: RawConfig = layers
        // No `try_parsing`: it would turn a numeric-looking token into a number.
        // Typed fields parse their strings; `router` splits on commas.
        .add_source(config::Environment::with_prefix("KVROUTE_SIDECAR"))
        .build()
        .context("reading the config file and KVROUTE_SIDECAR_* environment")?
        .try_deserialize()
        .context("invalid config file or KVROUTE_SIDECAR_* environment")?;
    let raw = cli.into_raw().or(lower);
    let listen = raw.listen.clone().unwrap_or_else(|| "127.0.0.1:9100".into());
    let config = raw.validate(&hostname())?;
    let listener = tokio::net::TcpListener::bind(&listen).await.with_context(|| format!("binding {listen}"))?;
    // Tools parse this line to find the bound port (with --listen 127.0.0.1:0).
    println!("listening on http://{}", listener.local_addr()?);
    kvroute_sidecar::run(listener, config, stop).await?;
    Ok(())
}

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "sidecar".into())
}
