//! KV events from a running simulator, as a sidecar sees them: a ZMQ
//! subscriber gets one batch per step with consecutive seqs, faults pause or
//! drop batches, and replay fills a gap. Requests here generate one token, so
//! each publishes exactly one batch (its prompt blocks).

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{Running, start, with_events};
use kvroute_sim::Config;
use serde_json::json;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

async fn recv_batch(sub: &mut SubSocket, wait: Duration) -> Option<(u64, rmpv::Value)> {
    let msg = tokio::time::timeout(wait, sub.recv()).await.ok()?.expect("recv");
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3);
    assert_eq!(&frames[0][..], b"kv-events");
    let seq = u64::from_be_bytes(frames[1][..].try_into().expect("8 bytes"));
    Some((seq, rmpv::decode::read_value(&mut &frames[2][..]).expect("msgpack")))
}

fn event_type(batch: &rmpv::Value, i: usize) -> String {
    let ev = batch[1][i].as_map().expect("map");
    ev.iter().find(|(k, _)| k.as_str() == Some("type")).and_then(|(_, v)| v.as_str()).expect("type").to_owned()
}

/// Connects a subscriber and waits until it is live: a PUB drops what it
/// sends before the subscription arrives, so send one-block requests (each
/// publishes one batch, a single `BlockStored`) until one gets through.
/// Returns the last seq seen.
async fn subscribe(sim: &Running) -> (SubSocket, u64) {
    let endpoint = sim.info.kv_events.clone().expect("events on");
    assert!(endpoint.starts_with("tcp://127.0.0.1:") && !endpoint.ends_with(":0"), "{endpoint}");
    let mut sub = SubSocket::new();
    sub.connect(&endpoint).await.expect("connect");
    sub.subscribe("").await.expect("subscribe");
    // In a fresh simulator only these requests publish, so request i has seq i.
    let mut posted = 0u64;
    let mut seen = None;
    while seen.is_none() && posted < 50 {
        let prompt: Vec<u32> = (0..16).map(|t| 50_000 + posted as u32 * 16 + t).collect();
        sim.post("/v1/completions", json!({"model": "m", "prompt": prompt, "max_tokens": 1})).await;
        posted += 1;
        seen = recv_batch(&mut sub, Duration::from_millis(100)).await;
    }
    let (mut seq, batch) = seen.expect("subscriber never received a batch");
    assert_eq!(event_type(&batch, 0), "BlockStored");
    // Drain the batches still in flight, up to the last request posted.
    while seq + 1 < posted {
        let (s, batch) = recv_batch(&mut sub, Duration::from_secs(5)).await.expect("a posted request's batch");
        assert_eq!(event_type(&batch, 0), "BlockStored");
        seq = s;
    }
    (sub, seq)
}

#[tokio::test]
async fn events_reach_a_subscriber() {
    let sim = start(with_events(Config::for_model("m"))).await;
    assert!(sim.info.kv_replay.is_some());
    let (mut sub, seq) = subscribe(&sim).await;
    let prompt: Vec<u32> = (0..40).collect();
    sim.post("/v1/completions", json!({"model": "m", "prompt": prompt})).await;
    let (s, batch) = recv_batch(&mut sub, Duration::from_secs(5)).await.expect("stored batch");
    assert_eq!(s, seq + 1);
    assert_eq!(event_type(&batch, 0), "BlockStored");
    let ev = batch[1][0].as_map().expect("map");
    let field = |name: &str| ev.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v.clone()).expect(name);
    assert_eq!(field("block_hashes").as_array().expect("hashes").len(), 2);
    assert_eq!(field("token_ids").as_array().expect("ids").len(), 32);
    assert_eq!(field("block_size").as_u64(), Some(16));
    assert!(field("parent_block_hash").is_nil());
    assert_eq!(batch[2].as_u64(), Some(0), "data_parallel_rank");
}

#[tokio::test]
async fn paused_batches_arrive_on_resume_and_dropped_ones_replay() {
    let sim = start(with_events(Config::for_model("m"))).await;
    let (mut sub, seq) = subscribe(&sim).await;

    sim.post("/sim/faults", json!({"pause_events": true})).await;
    sim.post("/v1/completions", json!({"model": "m", "prompt": vec![1; 40], "max_tokens": 1})).await;
    assert!(recv_batch(&mut sub, Duration::from_millis(300)).await.is_none(), "paused publisher sent");
    sim.post("/sim/faults", json!({"pause_events": false})).await;
    let (s, _) = recv_batch(&mut sub, Duration::from_secs(5)).await.expect("held batch");
    assert_eq!(s, seq + 1);

    sim.post("/sim/faults", json!({"drop_events": 1.0})).await;
    sim.post("/v1/completions", json!({"model": "m", "prompt": vec![2; 40], "max_tokens": 1})).await;
    let mut dealer = DealerSocket::new();
    dealer.connect(sim.info.kv_replay.as_deref().expect("replay on")).await.expect("connect");
    // The request has finished, but its batch may still be on its way to the
    // publisher: wait until replay has it (its drop is decided by then).
    let mut replayed = Vec::new();
    for _ in 0..500 {
        replayed = replay(&mut dealer, seq + 2).await;
        if !replayed.is_empty() {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(replayed, vec![seq + 2]);
    sim.post("/sim/faults", json!({"drop_events": 0.0})).await;
    sim.post("/v1/completions", json!({"model": "m", "prompt": vec![3; 40], "max_tokens": 1})).await;
    let (s, _) = recv_batch(&mut sub, Duration::from_secs(5)).await.expect("batch after the gap");
    assert_eq!(s, seq + 3, "the dropped batch leaves a gap");
    assert_eq!(replay(&mut dealer, seq + 2).await, vec![seq + 2, seq + 3], "replay fills it");
}

/// One replay exchange: the seqs of the batches returned, checking the frames.
async fn replay(dealer: &mut DealerSocket, start: u64) -> Vec<u64> {
    let start = Bytes::copy_from_slice(&start.to_be_bytes());
    let req = ZmqMessage::try_from(vec![Bytes::new(), start]).expect("frames");
    dealer.send(req).await.expect("send");
    let mut seqs = Vec::new();
    loop {
        let frames = dealer.recv().await.expect("reply").into_vec();
        assert_eq!(frames.len(), 4, "[\"\", topic, seq, payload]");
        assert!(frames[0].is_empty());
        let s = i64::from_be_bytes(frames[2][..].try_into().expect("8 bytes"));
        if s == -1 {
            assert!(frames[1].is_empty() && frames[3].is_empty(), "end marker");
            return seqs;
        }
        assert_eq!(&frames[1][..], b"kv-events");
        seqs.push(s as u64);
    }
}
