//! Bounded fuzzing of the msgpack event decoder (proptest-driven, part of the
//! normal test run): arbitrary bytes and mutations of real vLLM captures never
//! panic, and whatever decodes translates without panicking either.
//! Longer runs: `PROPTEST_CASES=200000 cargo test -p kvroute-sidecar --test fuzz_decode`.

use std::path::PathBuf;

use kvroute_shared::{BlockSize, ModelName};
use kvroute_sidecar::decode::{EventBatch, KvEvent, decode_message, decode_payload};
use kvroute_sidecar::metrics::TranslateCounters;
use kvroute_sidecar::translate::{NullSink, Rank, Translator};
use proptest::prelude::*;
use serde_json::Value;

/// Every payload of the vLLM 0.33 and 0.11 captures.
fn captured_payloads() -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/vllm-events");
    let mut out = Vec::new();
    for name in ["vllm-0.33.0.jsonl", "vllm-0.11.0.jsonl"] {
        let text = std::fs::read_to_string(dir.join(name)).expect("capture present");
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let v: Value = serde_json::from_str(line).expect("json");
            let payload = v["frames_hex"][2].as_str().expect("payload frame");
            out.push(hex::decode(payload).expect("hex"));
        }
    }
    assert!(out.len() >= 16);
    out
}

/// Translates what decoded: no panic, and never more keys than blocks stored.
fn translate(batch: &EventBatch) -> Result<(), TestCaseError> {
    let mut t = Translator::new(ModelName::new("m"), BlockSize::new(16).unwrap(), TranslateCounters::default());
    let rank = Rank(batch.data_parallel_rank.unwrap_or(0));
    let mut stored = 0;
    for event in &batch.events {
        t.apply(rank, event, &mut NullSink);
        if let KvEvent::BlockStored(ev) = event {
            stored += ev.block_hashes.len();
        }
    }
    prop_assert_eq!(t.keys().count(), t.key_count());
    prop_assert!(t.key_count() <= stored, "{} keys from {} stored blocks", t.key_count(), stored);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_payload(&bytes);
        let _ = decode_message(&[b"kv".as_slice(), &[0u8; 8], &bytes]);
    }

    #[test]
    fn mutated_captures_never_panic(
        which in any::<prop::sample::Index>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let payloads = captured_payloads();
        let mut p = payloads[which.index(payloads.len())].clone();
        for (at, byte) in flips {
            let i = at.index(p.len());
            p[i] = byte;
        }
        let keep = cut.index(p.len() + 1);
        p.truncate(keep.max(1));
        if let Ok(batch) = decode_payload(&p) {
            translate(&batch)?;
        }
    }

    #[test]
    fn bad_frames_are_errors(frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..12), 0..5)) {
        let r = decode_message(&frames);
        if frames.len() != 3 {
            prop_assert!(r.is_err());
        }
    }
}
