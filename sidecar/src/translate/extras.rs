//! What a block's `extra_keys` mean for its router key (DESIGN.md §5).
//!
//! vLLM lists, untagged and in order: the LoRA name (when `lora_name` is set),
//! `(mm_identifier, offset)` pairs, the `cache_salt` (first block of a request
//! only), prompt-embedding digests. A text request can only ever match blocks
//! with no multimodal or embedding input, so those blocks are skipped.

use crate::decode::ExtraKey;

/// Why a block gets no router key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum SkipReason {
    /// Multimodal input in the block.
    Multimodal,
    /// Prompt embeddings instead of tokens.
    PromptEmbeds,
    /// An extra key of a kind this sidecar cannot interpret.
    UnknownExtraKey,
    /// A LoRA block without `lora_name` (vLLM before 0.11.1 sent only `lora_id`):
    /// its model name, hence its root, is unknown.
    UnnamedLora,
    /// `token_ids` is not `block_hashes.len() * block_size` long.
    BadLength,
}

impl SkipReason {
    pub const ALL: [SkipReason; 5] = [
        SkipReason::Multimodal,
        SkipReason::PromptEmbeds,
        SkipReason::UnknownExtraKey,
        SkipReason::UnnamedLora,
        SkipReason::BadLength,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::Multimodal => "multimodal",
            SkipReason::PromptEmbeds => "prompt_embeds",
            SkipReason::UnknownExtraKey => "unknown_extra_key",
            SkipReason::UnnamedLora => "unnamed_lora",
            SkipReason::BadLength => "bad_length",
        }
    }
}

/// Classifies one block's extra keys: `Ok(salt)` when the block is keyable
/// (`salt` is the cache salt, only looked for in a request's first block).
pub fn classify<'a>(
    keys: Option<&'a [ExtraKey]>,
    lora_name: Option<&str>,
    first_of_request: bool,
) -> Result<Option<&'a str>, SkipReason> {
    let mut salt = None;
    let mut lora_seen = false;
    for key in keys.unwrap_or_default() {
        match key {
            ExtraKey::Text(s) if !lora_seen && lora_name == Some(&**s) => lora_seen = true,
            ExtraKey::Text(s) if first_of_request && salt.is_none() => salt = Some(&**s),
            ExtraKey::Text(_) | ExtraKey::Other => return Err(SkipReason::UnknownExtraKey),
            ExtraKey::Tuple => return Err(SkipReason::Multimodal),
            ExtraKey::Bytes => return Err(SkipReason::PromptEmbeds),
        }
    }
    Ok(salt)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> ExtraKey {
        ExtraKey::Text(s.into())
    }

    #[test]
    fn lora_then_salt_on_first_block() {
        let keys = [text("sql"), text("tenant-a")];
        assert_eq!(classify(Some(&keys), Some("sql"), true), Ok(Some("tenant-a")));
        assert_eq!(classify(Some(&keys[..1]), Some("sql"), false), Ok(None));
        assert_eq!(classify(Some(&keys[1..]), None, true), Ok(Some("tenant-a")));
        assert_eq!(classify(Some(&keys[1..]), None, false), Err(SkipReason::UnknownExtraKey));
        assert_eq!(classify(None, None, true), Ok(None));
    }

    #[test]
    fn multimodal_and_embeddings_are_skipped() {
        assert_eq!(classify(Some(&[ExtraKey::Tuple]), None, true), Err(SkipReason::Multimodal));
        assert_eq!(classify(Some(&[ExtraKey::Bytes]), None, false), Err(SkipReason::PromptEmbeds));
    }
}
