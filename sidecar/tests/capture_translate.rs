//! The captured vLLM batches, decoded and translated: the keys the sidecar
//! reports are exactly the router keys of the blocks the engine holds.

use std::collections::HashSet;
use std::path::PathBuf;

use bytes::Bytes;
use kvroute_shared::{BlockKey, BlockSize, KeyRoot, ModelName, block_keys};
use kvroute_sidecar::decode::decode_message;
use kvroute_sidecar::metrics::TranslateCounters;
use kvroute_sidecar::translate::{NullSink, Rank, SkipReason, Translator};

fn batches(version: &str) -> Vec<Vec<Bytes>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../testdata/vllm-events/vllm-{version}.jsonl"));
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["frames_hex"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| Bytes::from(hex::decode(f.as_str().unwrap()).unwrap()))
                .collect()
        })
        .collect()
}

fn keys(model: &str, tokens: &[u32]) -> Vec<BlockKey> {
    block_keys(KeyRoot::new(model, None), tokens, BlockSize::new(4).unwrap())
}

fn replay(version: &str, upto: usize) -> Translator {
    let mut t = Translator::new(ModelName::new("m"), BlockSize::new(4).unwrap(), TranslateCounters::default());
    for frames in batches(version).iter().take(upto) {
        let (_, batch) = decode_message(frames).unwrap();
        let rank = Rank(batch.data_parallel_rank.unwrap_or(0));
        for ev in &batch.events {
            t.apply(rank, ev, &mut NullSink);
        }
    }
    t
}

fn held(t: &Translator) -> HashSet<BlockKey> {
    t.keys().collect()
}

#[test]
fn vllm_0_33_capture_translates_to_router_keys() {
    let chain = keys("m", &(0..12).collect::<Vec<_>>());
    let after_wrap = BlockKey::chain(chain[2], &[50256, 0, 1, 2]);
    let lora = keys("sql-adapter", &[7, 7, 7, 7])[0];
    let bytes_hashed = keys("m", &[1, 2, 3, 4])[0];
    let t = replay("0.33.0", 5);
    let want: HashSet<_> = [chain[0], chain[1], chain[2], after_wrap, lora, bytes_hashed].into_iter().collect();
    assert_eq!(held(&t), want, "seq 0-4: the CPU-tier store (seq 4) is not GPU state");
    let t = replay("0.33.0", 6);
    assert_eq!(held(&t), [chain[0], chain[1], bytes_hashed].into_iter().collect());
    let t = replay("0.33.0", 8);
    assert_eq!(held(&t), [keys("m", &[100000, 151643, 3, 4])[0]].into_iter().collect(), "cleared, then rank 1");
}

#[test]
fn vllm_0_11_capture_skips_unnamed_lora() {
    let counters = TranslateCounters::default();
    let mut t = Translator::new(ModelName::new("m"), BlockSize::new(4).unwrap(), counters.clone());
    for frames in batches("0.11.0").iter().take(5) {
        let (_, batch) = decode_message(frames).unwrap();
        for ev in &batch.events {
            t.apply(Rank(0), ev, &mut NullSink);
        }
    }
    // 0.11 sends lora_id without lora_name: the adapter's root is unknown.
    assert_eq!(t.key_count(), 5);
    assert_eq!(counters.skipped(SkipReason::UnnamedLora).get(), 1);
    assert_eq!(counters.offload_events.get(), 1);
}
