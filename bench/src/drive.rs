//! Drives a workload against one or more router URLs: open-loop arrivals at
//! their scheduled times, closed-loop requests after the request they follow,
//! never more than `concurrency` in flight, request `i` sent to target
//! `i mod targets` (two router replicas: clients alternate).

use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use tokio::sync::{Semaphore, watch};

use crate::client::{self, Outcome};
use crate::words::Words;
use crate::workload::Workload;

#[derive(Debug, Clone)]
pub struct DriveOptions {
    pub model: String,
    /// Send `ignore_eos` (real vLLM: fixed output lengths).
    pub ignore_eos: bool,
    pub concurrency: usize,
    /// Per-request bound: a stuck request fails instead of hanging the run.
    pub request_timeout: Duration,
    /// Send prompts as text in these words (`None`: token ids).
    pub words: Option<Arc<Words>>,
}

#[derive(Debug)]
pub struct RunOutcome {
    /// Per request, in workload order: the outcome or the error text.
    pub results: Vec<Result<Outcome, String>>,
    /// Per request, when it was sent, from the start of the run (closed
    /// loop: after its predecessor's answer and the think time).
    pub sent: Vec<Option<Duration>>,
    /// First send to last completion.
    pub wall: Duration,
}

pub async fn drive(
    http: &reqwest::Client,
    workload: &Workload,
    targets: &[String],
    opts: &DriveOptions,
    progress: &ProgressBar,
) -> RunOutcome {
    let n = workload.requests.len();
    let gate = Arc::new(Semaphore::new(opts.concurrency.max(1)));
    let (done_tx, done_rx): (Vec<_>, Vec<_>) = (0..n).map(|_| watch::channel(false)).unzip();
    let done_tx: Arc<Vec<watch::Sender<bool>>> = Arc::new(done_tx);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for (i, req) in workload.requests.iter().enumerate() {
        let req = req.clone();
        let follows = req.after.map(|a| (done_rx[a.request].clone(), a.think));
        let gate = gate.clone();
        let done_tx = done_tx.clone();
        let http = http.clone();
        let target = targets[i % targets.len()].clone();
        let opts = opts.clone();
        let progress = progress.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until((start + req.arrival).into()).await;
            if let Some((mut rx, think)) = follows {
                // A failed predecessor also signals, so sessions never stall.
                let _ = rx.wait_for(|d| *d).await;
                tokio::time::sleep(think).await;
            }
            // Its arrival: TTFT counts from here, so time spent waiting for
            // the client's concurrency cap (a router falling behind) counts;
            // timed from sending, a backlog at the cap went unseen.
            let arrived = Instant::now();
            let permit = gate.acquire_owned().await;
            let tokens = req.prompt.tokens();
            let body = match &opts.words {
                Some(words) => client::text_completion_body(&opts.model, &words.text(&tokens), req.max_tokens, true),
                None => client::completion_body(&opts.model, &tokens, req.max_tokens, true, opts.ignore_eos),
            };
            let sent_at = Instant::now();
            let waited = sent_at.saturating_duration_since(arrived);
            let result = client::complete(&http, &target, body, opts.request_timeout)
                .await
                .map(|o| client::Outcome { ttft: o.ttft + waited, latency: o.latency + waited, ..o })
                .map_err(|e| e.to_string());
            drop(permit);
            let _ = done_tx[i].send(true);
            progress.inc(1);
            (sent_at, Instant::now(), result)
        }));
    }
    let mut results = Vec::with_capacity(n);
    let mut sent_times = Vec::with_capacity(n);
    let (mut first, mut last): (Option<Instant>, Option<Instant>) = (None, None);
    for t in tasks {
        match t.await {
            Ok((sent, ended, r)) => {
                first = Some(first.map_or(sent, |f| f.min(sent)));
                last = Some(last.map_or(ended, |l| l.max(ended)));
                results.push(r);
                sent_times.push(Some(sent.saturating_duration_since(start)));
            }
            Err(e) => {
                results.push(Err(format!("task failed: {e}")));
                sent_times.push(None);
            }
        }
    }
    let wall = match (first, last) {
        (Some(f), Some(l)) => l.saturating_duration_since(f),
        _ => Duration::ZERO,
    };
    RunOutcome { results, sent: sent_times, wall }
}
