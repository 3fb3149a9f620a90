//! The benchmark's error type: what failed and where, so a broken run says
//! whether the cluster, a file or an HTTP call was at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("cluster: {0}")]
    Cluster(#[from] kvroute_sim::cluster::ClusterError),
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("trace line {line}: {source}")]
    TraceLine {
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("{url}: {source}")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url}: unexpected answer: {message}")]
    Unexpected { url: String, message: String },
    #[error("unknown workload {0:?} (known: shared_prefix, chat, rag, or --trace FILE)")]
    UnknownWorkload(String),
    #[error("{0}")]
    Usage(String),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("finding free ports: {0}")]
    Ports(#[source] std::io::Error),
    #[error("cannot start {path}: {source}")]
    Spawn {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("engine {name}: {message}")]
    Engine { name: String, message: String },
    #[error("interrupted (Ctrl-C or SIGTERM); engines stopped")]
    Interrupted,
}
