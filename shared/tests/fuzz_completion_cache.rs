//! The completion path's cache (issue 16): texts cut at line and word starts
//! and encoded chunk by chunk, cold and warm, with and without special tokens,
//! give exactly the whole-text ids, for the GPT-2 and Qwen3 tokenizers.

use proptest::prelude::*;

mod support;

use support::tokenizers;

fn line() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9 .,'!?()#-]{0,80}",
        "( [a-zA-Z]{1,10}){1,120}",
        "[ \t]{0,4}[a-z_]{1,8}\\([a-z, ]{0,20}\\);",
        Just("naïve café — 東京 🚀".to_string()),
        Just("\u{301}combining".to_string()),
        Just("'s and 're".to_string()),
        Just("<|endoftext|>".to_string()),
        Just("<|im_start|>user".to_string()),
        ".{0,12}",
    ]
}

fn separator() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("\n"), Just("\n\n"), Just(" \n"), Just("\r\n"), Just("\n  "), Just(" ")]
}

fn text() -> impl Strategy<Value = String> {
    proptest::collection::vec((line(), separator()), 0..80)
        .prop_map(|parts| parts.into_iter().flat_map(|(l, s)| [l, s.to_string()]).collect())
}

#[test]
fn gpt2_and_qwen3_cut_lines_and_know_their_special_tokens() {
    for (name, tok) in tokenizers() {
        assert!(tok.caches_lines(), "{name}: line-start cuts should be exact for byte-level BPE");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn chunked_encoding_is_whole_text_encoding(t in text(), suffix in text(), special in any::<bool>()) {
        for (name, tok) in tokenizers() {
            let whole = tok.encode_uncached(&t, special).unwrap();
            prop_assert_eq!(&tok.encode(&t, special).unwrap(), &whole, "{} cold: {:?}", name, t);
            prop_assert_eq!(&tok.encode(&t, special).unwrap(), &whole, "{} warm: {:?}", name, t);
            // A second text sharing the first as its prefix reuses its chunks.
            let longer = format!("{t}{suffix}");
            prop_assert_eq!(
                &tok.encode(&longer, special).unwrap(),
                &tok.encode_uncached(&longer, special).unwrap(),
                "{} shared prefix: {:?}", name, longer
            );
        }
    }
}
