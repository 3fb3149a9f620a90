//! Golden tests: every message vLLM 0.33.0 and 0.32.0 (map events) and 0.11.0
//! (positional events) published in the captures decodes to exactly its
//! recorded `expect`, with no unknown field, and the replay exchanges parse to
//! the same batches.

use std::path::PathBuf;

use bytes::Bytes;
use kvroute_sidecar::decode::{self, Encoding, EngineHash, EventBatch, KvEvent, Seq};
use kvroute_sidecar::replay;
use serde_json::{Value, json};

fn capture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/vllm-events")
}

fn hash_json(h: &EngineHash) -> Value {
    match h {
        EngineHash::Int(n) => json!({ "u64": n }),
        EngineHash::Bytes(b) => json!({ "bytes_hex": hex::encode(b) }),
    }
}

/// Renders a decoded batch in the captures' `expect` shape. `lora_name` exists
/// only in the map encoding (vLLM 0.11's positional events end at `medium`).
fn batch_json(seq: Seq, batch: &EventBatch) -> Value {
    let events: Vec<Value> = batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => {
                let mut v = json!({
                    "type": "BlockStored",
                    "block_hashes": s.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
                    "parent_block_hash": s.parent_block_hash.as_ref().map(hash_json),
                    "token_ids": s.token_ids,
                    "block_size": s.block_size,
                    "lora_id": s.lora_id,
                    "medium": s.medium.as_ref().map(|m| m.as_str()),
                });
                if batch.encoding == Some(Encoding::Map) || s.lora_name.is_some() {
                    v["lora_name"] = json!(s.lora_name);
                }
                v
            }
            KvEvent::BlockRemoved(r) => json!({
                "type": "BlockRemoved",
                "block_hashes": r.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
                "medium": r.medium.as_ref().map(|m| m.as_str()),
            }),
            KvEvent::AllBlocksCleared => json!({"type": "AllBlocksCleared"}),
            KvEvent::Unknown => json!({"type": "?"}),
        })
        .collect();
    json!({ "seq": seq.0, "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events })
}

fn lines(version: &str) -> Vec<Value> {
    let path = capture_dir().join(format!("vllm-{version}.jsonl"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn frames(v: &Value) -> Vec<Bytes> {
    v.as_array().unwrap().iter().map(|f| Bytes::from(hex::decode(f.as_str().unwrap()).unwrap())).collect()
}

fn check_capture(version: &str, encoding: Encoding) {
    let lines = lines(version);
    assert_eq!(lines.len(), 8, "{version}");
    for line in &lines {
        let (seq, batch) = decode::decode_message(&frames(&line["frames_hex"])).unwrap();
        assert_eq!(batch_json(seq, &batch), line["expect"], "{version} seq {}", seq.0);
        assert_eq!(batch.encoding, Some(encoding));
        assert_eq!(batch.unknown_fields, 0);
    }
}

#[test]
fn vllm_0_33_map_events_decode_exactly() {
    check_capture("0.33.0", Encoding::Map);
}

/// Captured from a real vLLM 0.32.0 (CPU build) by scripts/capture_vllm_events.py:
/// 14-field BlockStored, 5-field BlockRemoved, AllBlocksCleared.
#[test]
fn vllm_0_32_map_events_decode_exactly() {
    check_capture("0.32.0", Encoding::Map);
}

#[test]
fn vllm_0_32_replay_exchange() {
    check_replay("0.32.0");
}

#[test]
fn vllm_0_11_positional_events_decode_exactly() {
    check_capture("0.11.0", Encoding::Positional);
}

fn check_replay(version: &str) {
    let path = capture_dir().join(format!("vllm-{version}.replay-from-5.json"));
    let exchange: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let request: Vec<Bytes> = replay::request(Seq(5));
    assert_eq!(request, frames(&exchange["request_frames_hex"]));
    let expected: Vec<Value> = lines(version)
        .into_iter()
        .filter(|l| l["expect"]["seq"].as_u64().unwrap() >= 5)
        .map(|l| l["expect"].clone())
        .collect();
    let replies = exchange["reply_messages_hex"].as_array().unwrap();
    assert_eq!(replies.len(), expected.len() + 1);
    for (reply, want) in replies.iter().zip(&expected) {
        let frames = frames(reply);
        let (seq, payload) = replay::parse_reply(&frames).unwrap().expect("a batch, not the end marker");
        let batch = decode::decode_payload(payload).unwrap();
        assert_eq!(&batch_json(seq, &batch), want, "{version} replayed seq {}", seq.0);
    }
    let end = frames(replies.last().unwrap());
    assert!(replay::parse_reply(&end).unwrap().is_none(), "last reply is the end marker");
}

#[test]
fn vllm_0_33_replay_exchange() {
    check_replay("0.33.0");
}

#[test]
fn vllm_0_11_replay_exchange() {
    check_replay("0.11.0");
}

#[test]
fn unknown_fields_and_types_are_ignored() {
    use rmpv::Value as M;
    let stored = M::Map(vec![
        (M::from("type"), M::from("BlockStored")),
        (M::from("block_hashes"), M::Array(vec![M::from(-5i64)])),
        (M::from("parent_block_hash"), M::Nil),
        (M::from("token_ids"), M::Array(vec![M::from(1), M::from(2)])),
        (M::from("block_size"), M::from(2)),
        // vLLM 0.32's fields are known ...
        (M::from("group_idx"), M::from(0)),
        (M::from("kv_cache_spec_kind"), M::from("full")),
        (M::from("locality"), M::Nil),
        (M::from("session_id"), M::Nil),
        // ... fields from a later vLLM are counted.
        (M::from("future_a"), M::from(1)),
        (M::from("future_b"), M::Nil),
    ]);
    let future = M::Map(vec![(M::from("type"), M::from("BlockPinned"))]);
    let legacy = M::Array(vec![M::from("BlockRemoved"), M::Array(vec![M::from(7)]), M::from("GPU"), M::from(0)]);
    let payload = M::Array(vec![M::F64(1.5), M::Array(vec![stored, future, legacy])]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &payload).unwrap();
    let batch = decode::decode_payload(&buf).unwrap();
    assert_eq!(batch.data_parallel_rank, None, "very old payloads have no rank");
    assert_eq!(batch.unknown_fields, 3);
    assert!(matches!(batch.events[1], KvEvent::Unknown));
    let KvEvent::BlockStored(s) = &batch.events[0] else { panic!() };
    assert_eq!(s.block_hashes, vec![EngineHash::Int(-5i64 as u64)]);
}

#[test]
fn bytes_hash_id_matches_vllm_int_conversion() {
    // vLLM: int.from_bytes(hash_bytes, "big") & (2**64 - 1) — the last 8 bytes.
    let bytes: Vec<u8> = (0u8..32).collect();
    let id = EngineHash::Bytes(bytes.into()).id();
    assert_eq!(id, 0x18191a1b1c1d1e1f);
}
