//! `kvroute-bench`: parse the command line, run the benchmark, print where
//! the report went.

use clap::Parser;
use kvroute_bench::cli::Cli;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let summary = kvroute_bench::run(cli.command).await?;
    println!("{summary}");
    Ok(())
}
