//! kvroute-router: parse the command line, set up logging, load the config,
//! run (or run the `tokenize` tool).

use std::io::Read;

use anyhow::Context;
use clap::Parser;
use kvroute_router::cli::{Cli, Command, TokenizeArgs};
use kvroute_shared::openai::PromptRequest;
use kvroute_shared::tokenize::PromptTokenizer;
use kvroute_shared::{BlockSize, KeyRoot, block_keys};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Command::Tokenize(args)) = &cli.command {
        return tokenize(args);
    }
    // Before anything slow (binding, loading tokenizers): a stop asked for
    // meanwhile is kept, not lost.
    let stop = kvroute_serve::signals::stop_requested().context("installing the signal handlers")?;
    kvroute_shared::logging::init(
        cli.serve.log_level.as_deref(),
        cli.serve.log_format.as_deref(),
        kvroute_shared::logging::Output::Stdout,
    )?;
    let unknown = kvroute_router::cli::unknown_env(std::env::vars());
    if !unknown.is_empty() {
        tracing::warn!(variables = ?unknown, "ignoring KVROUTE_ variables the router does not read (misspelt?)");
    }
    let raw = cli.serve.load(std::env::vars()).context("loading configuration")?;
    let config = raw.validate()?;
    // Certificates are read before anything announces an https address.
    if let (Some(cert), Some(key)) = (&config.raw.tls_cert, &config.raw.tls_key) {
        kvroute_router::tls::server_config(cert, key)?;
    }
    let listener = bind(config.raw.listen).await.with_context(|| format!("binding {}", config.raw.listen))?;
    let metrics = match config.raw.metrics_listen {
        Some(addr) => Some(bind(addr).await.with_context(|| format!("binding the metrics listener {addr}"))?),
        None => None,
    };
    let addr = listener.local_addr()?;
    // Parents (the local cluster, tests) read this line to find the port.
    let scheme = if config.raw.tls_cert.is_some() { "https" } else { "http" };
    println!("listening on {scheme}://{addr}");
    if let Some(m) = &metrics {
        println!("metrics on http://{}/metrics", m.local_addr()?);
    }
    tracing::info!(%addr, policy = ?config.policy, workers = config.workers.len(), "kvroute-router started");
    if config.raw.admin_token.is_none() && !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "no admin_token: /admin/workers and /debug/* are open to every client (the workers' URLs, \
             which prompts are cached where); set admin_token wherever clients reach the router"
        );
    }
    let listeners = kvroute_router::Listeners { api: listener, metrics };
    kvroute_router::run_with(listeners, config, stop).await?;
    Ok(())
}

/// Binds `addr`, waiting up to 10 s while the address is in use: a router
/// restarted by a supervisor often starts while the old process still drains.
async fn bind(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tokio::time::Instant::now() < deadline => {
                tracing::warn!(%addr, "address in use (a previous router still exiting?); retrying");
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
            r => return r,
        }
    }
}

/// `kvroute-router tokenize`: what the router computes for a request body.
fn tokenize(args: &TokenizeArgs) -> anyhow::Result<()> {
    let mut body = Vec::new();
    std::io::stdin().read_to_end(&mut body).context("reading the request body from stdin")?;
    let endpoint = kvroute_router::admin::endpoint_of(&body);
    let mut req = PromptRequest::parse(endpoint, &body).map_err(|e| anyhow::anyhow!("bad request body: {e}"))?;
    req.resolve_truncation(args.max_prompt_tokens);
    if let PromptRequest::Chat(c) = &mut req {
        let raw = kvroute_router::config::RawConfig {
            default_chat_template_kwargs: args.default_chat_template_kwargs.clone(),
            exclude_tools_when_tool_choice_none: args.exclude_tools_when_tool_choice_none,
            ..Default::default()
        };
        c.defaults = raw.validate()?.chat_defaults;
    }
    let tokenizer = match &args.tokenizer {
        Some(dir) => PromptTokenizer::load(dir)?,
        None => PromptTokenizer::Bytes,
    };
    let tokens = tokenizer.prompt_tokens(&req)?;
    let bs = BlockSize::new(args.block_size)?;
    let keys = block_keys(KeyRoot::new(req.model(), req.cache_salt()), &tokens, bs);
    println!("{}", serde_json::json!({"token_ids": tokens, "block_keys": keys}));
    Ok(())
}
