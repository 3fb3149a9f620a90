//! `kvroute-sim`: parse flags, bind, print the discovery lines, serve until
//! Ctrl-C / SIGTERM. `kvroute-sim cluster` starts a whole local cluster instead.

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvroute_sim::cluster::{ClusterArgs, run_cluster};
use kvroute_sim::{Args, Sim};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(name = "kvroute-sim", version, about = "A simulated vLLM engine", args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    engine: Args,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a local cluster: simulated engines, a sidecar each, and a router.
    Cluster(ClusterArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Command::Cluster(args)) = cli.command {
        // The cluster's children log for themselves; this process only prints
        // where things are.
        run_cluster(args).await?;
        return Ok(());
    }
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = cli.engine;
    let listen = args.listen.clone();
    let config = args.into_config()?;
    let listener =
        tokio::net::TcpListener::bind(&listen).await.with_context(|| format!("cannot listen on {listen}"))?;
    let sim = Sim::start(listener, config).await?;
    // Parent processes read these lines from stdout to find the bound ports.
    for line in sim.discovery_lines() {
        println!("{line}");
        tracing::info!("{line}");
    }
    sim.serve(shutdown_signal()).await?;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
