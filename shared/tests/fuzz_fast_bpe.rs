//! The cold-text fast path (`shared/src/tokenize/fast_bpe.rs`, issue 16):
//! ASCII text split by the hand-written pre-tokenizer and BPE-encoded piece
//! by piece gives exactly HF's whole-text ids, for the GPT-2 and Qwen3
//! tokenizers, on arbitrary ASCII (every byte, every run of classes) and on
//! prose and code; a text with any non-ASCII byte goes through HF.

use proptest::prelude::*;

mod support;

use support::tokenizers;

/// Short runs of one character class each, so that every boundary the
/// regexes care about (space before a word, runs of spaces before text or at
/// the end, line breaks inside space runs, contractions in any case, digits
/// after spaces, punctuation before letters) comes up often.
fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z]{1,6}",
        "[0-9]{1,5}",
        "[ ]{1,3}",
        "[ \t\r\n\x0b\x0c]{1,4}",
        "[!-/:-@\\[-`{-~]{1,3}",
        "'(s|t|re|ve|m|ll|d|S|T|RE|Ve|M|LL|D|x)",
        "[\x00-\x1f\x7f]{1,2}",
        "[\x00-\x7f]{1,8}",
    ]
}

fn ascii_text() -> impl Strategy<Value = String> {
    proptest::collection::vec(piece(), 0..60).prop_map(|p| p.concat())
}

#[test]
fn gpt2_and_qwen3_take_the_fast_path() {
    for (name, tok) in tokenizers() {
        assert!(tok.fast_path(), "{name}: the fast path should be exact for this byte-level BPE");
    }
}

#[test]
fn prose_code_and_non_ascii_equal_whole_text_encoding() {
    let texts = [
        "The router keeps a map of which worker holds each block. It's fast; isn't it? 42 times, 3.14.\n".repeat(40),
        "fn main() {\n    let x = vec![1, 2, 3];\n\tprintln!(\"{x:?}\");\r\n}\n\n\n".repeat(30),
        "naïve café — 東京 🚀 and plain ASCII after it. ".repeat(30),
        "   \n\n  trailing   ".to_string(),
    ];
    for (name, tok) in tokenizers() {
        for t in &texts {
            for special in [false, true] {
                let whole = tok.encode_uncached(t, special).unwrap();
                assert_eq!(tok.encode(t, special).unwrap(), whole, "{name} {special}: {t:?}");
                assert_eq!(tok.encode(t, special).unwrap(), whole, "{name} {special} warm: {t:?}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn fast_ascii_encoding_is_whole_text_encoding(t in ascii_text(), special in any::<bool>()) {
        for (name, tok) in tokenizers() {
            let whole = tok.encode_uncached(&t, special).unwrap();
            prop_assert_eq!(&tok.encode(&t, special).unwrap(), &whole, "{} cold: {:?}", name, t);
            prop_assert_eq!(&tok.encode(&t, special).unwrap(), &whole, "{} warm: {:?}", name, t);
        }
    }
}
