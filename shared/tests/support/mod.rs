//! What the tokenizer property tests share: the real GPT-2 and Qwen3
//! tokenizers, loaded once per test binary.

use kvroute_shared::testdata::tokenizer_dir;
use kvroute_shared::tokenize::PromptTokenizer;

fn load(name: &str) -> PromptTokenizer {
    let dir = tokenizer_dir(name).unwrap_or_else(|why| {
        panic!("no {name} tokenizer: {why} (or place the shared test data at ../shared/testdata)")
    });
    PromptTokenizer::load(&dir).expect("loads")
}

/// `("gpt2", …)` and `("qwen3", …)`.
pub fn tokenizers() -> &'static [(&'static str, PromptTokenizer)] {
    static TOKS: std::sync::OnceLock<Vec<(&'static str, PromptTokenizer)>> = std::sync::OnceLock::new();
    TOKS.get_or_init(|| vec![("gpt2", load("gpt2")), ("qwen3", load("qwen3"))])
}
