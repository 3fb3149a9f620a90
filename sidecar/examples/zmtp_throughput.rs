//! How fast the sidecar's own ZMTP client (`kvroute_sidecar::zmtp`) takes
//! messages from a PUB socket, against the `zeromq` crate's SUB it replaced,
//! in one run: 100,000 messages of `[topic, seq, 1 KB]`, as vLLM publishes
//! its event batches (a busy engine publishes a few hundred a second).
//!
//! `cargo run --release -p kvroute-sidecar --example zmtp_throughput`

use std::time::{Duration, Instant};

use bytes::Bytes;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const MESSAGES: u64 = 100_000;

enum Sub {
    Own(kvroute_sidecar::zmtp::Subscription),
    Crate(zeromq::SubSocket),
}

impl Sub {
    async fn recv(&mut self) -> bool {
        let wait = Duration::from_secs(2);
        match self {
            Sub::Own(s) => matches!(tokio::time::timeout(wait, s.recv()).await, Ok(Ok(_))),
            Sub::Crate(s) => matches!(tokio::time::timeout(wait, s.recv()).await, Ok(Ok(_))),
        }
    }
}

async fn run(own: bool) -> (u64, Duration) {
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut sub = if own {
        Sub::Own(kvroute_sidecar::zmtp::Subscription::open(&endpoint, "").await.unwrap())
    } else {
        let mut s = zeromq::SubSocket::new();
        s.connect(&endpoint).await.unwrap();
        s.subscribe("").await.unwrap();
        Sub::Crate(s)
    };
    // The publisher drops what it sends before it has read the subscription.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let payload = Bytes::from(vec![7u8; 1000]);
    let sender = tokio::spawn(async move {
        for seq in 0..MESSAGES {
            let frames = vec![Bytes::from_static(b"kv"), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
            publisher.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
            if seq % 1000 == 0 {
                tokio::task::yield_now().await;
            }
        }
        publisher
    });
    let start = Instant::now();
    let mut received = 0;
    while received < MESSAGES && sub.recv().await {
        received += 1;
    }
    let elapsed = start.elapsed();
    drop(sender.await);
    (received, elapsed)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    for round in 1..=3 {
        for (own, name) in [(true, "kvroute_sidecar::zmtp"), (false, "zeromq crate SUB")] {
            let (received, elapsed) = run(own).await;
            let rate = received as f64 / elapsed.as_secs_f64();
            println!("round {round}: {name:<22} {received} messages in {elapsed:.2?}: {rate:.0} messages/s");
        }
    }
}
