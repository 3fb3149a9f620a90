//! Typed reads of msgpack values shared by both event encodings.

use rmpv::ValueRef;

use super::{DecodeError, EngineHash, ExtraKey, Medium};

pub(super) fn as_f64(v: &ValueRef<'_>) -> Option<f64> {
    match v {
        ValueRef::F64(f) => Some(*f),
        ValueRef::F32(f) => Some(f64::from(*f)),
        ValueRef::Integer(n) => n.as_f64(),
        _ => None,
    }
}

pub(super) fn as_u32(v: &ValueRef<'_>) -> Option<u32> {
    match v {
        ValueRef::Integer(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        _ => None,
    }
}

pub(super) fn hash(v: &ValueRef<'_>) -> Result<EngineHash, DecodeError> {
    match v {
        ValueRef::Integer(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Ok(EngineHash::Int(u)),
            // Older engines published Python's signed hash(); keep the bits.
            (None, Some(i)) => Ok(EngineHash::Int(i as u64)),
            (None, None) => Err(DecodeError::Shape("block hash integer out of range")),
        },
        ValueRef::Binary(b) => Ok(EngineHash::Bytes((*b).into())),
        _ => Err(DecodeError::Shape("block hash is neither an integer nor bytes")),
    }
}

pub(super) fn hashes(v: &ValueRef<'_>) -> Result<Vec<EngineHash>, DecodeError> {
    let ValueRef::Array(items) = v else {
        return Err(DecodeError::Shape("block_hashes is not an array"));
    };
    items.iter().map(hash).collect()
}

pub(super) fn opt_hash(v: &ValueRef<'_>) -> Result<Option<EngineHash>, DecodeError> {
    match v {
        ValueRef::Nil => Ok(None),
        v => hash(v).map(Some),
    }
}

pub(super) fn tokens(v: &ValueRef<'_>) -> Result<Vec<u32>, DecodeError> {
    let ValueRef::Array(items) = v else {
        return Err(DecodeError::Shape("token_ids is not an array"));
    };
    items.iter().map(|t| as_u32(t).ok_or(DecodeError::Shape("a token id is not a u32"))).collect()
}

pub(super) fn block_size(v: &ValueRef<'_>) -> Result<u32, DecodeError> {
    as_u32(v).ok_or(DecodeError::Shape("block_size is not a u32"))
}

pub(super) fn opt_i64(v: &ValueRef<'_>) -> Result<Option<i64>, DecodeError> {
    match v {
        ValueRef::Nil => Ok(None),
        ValueRef::Integer(n) => n.as_i64().map(Some).ok_or(DecodeError::Shape("lora_id out of range")),
        _ => Err(DecodeError::Shape("lora_id is not an integer")),
    }
}

pub(super) fn opt_string(v: &ValueRef<'_>, what: &'static str) -> Result<Option<String>, DecodeError> {
    match v {
        ValueRef::Nil => Ok(None),
        ValueRef::String(s) => s.as_str().map(|s| Some(s.to_owned())).ok_or(DecodeError::Shape(what)),
        _ => Err(DecodeError::Shape(what)),
    }
}

pub(super) fn opt_u32(v: &ValueRef<'_>, what: &'static str) -> Result<Option<u32>, DecodeError> {
    match v {
        ValueRef::Nil => Ok(None),
        v => as_u32(v).map(Some).ok_or(DecodeError::Shape(what)),
    }
}

/// `locality`: `None` or `"LOCAL"` is this engine; `"REMOTE"` another tier.
pub(super) fn is_remote(v: &ValueRef<'_>) -> Result<bool, DecodeError> {
    match v {
        ValueRef::Nil => Ok(false),
        ValueRef::String(s) => Ok(s.as_str() == Some("REMOTE")),
        _ => Err(DecodeError::Shape("locality is not a string")),
    }
}

pub(super) fn medium(v: &ValueRef<'_>) -> Result<Option<Medium>, DecodeError> {
    match v {
        ValueRef::Nil => Ok(None),
        ValueRef::String(s) => {
            s.as_str().map(|s| Some(Medium::parse(s))).ok_or(DecodeError::Shape("medium is not UTF-8"))
        }
        _ => Err(DecodeError::Shape("medium is not a string")),
    }
}

/// `extra_keys`: `None`, or one entry per block, each `None` or a tuple of keys.
pub(super) fn extra_keys(v: &ValueRef<'_>) -> Result<Option<Vec<Option<Vec<ExtraKey>>>>, DecodeError> {
    let items = match v {
        ValueRef::Nil => return Ok(None),
        ValueRef::Array(items) => items,
        _ => return Err(DecodeError::Shape("extra_keys is not an array")),
    };
    let per_block = items
        .iter()
        .map(|block| match block {
            ValueRef::Nil => Ok(None),
            ValueRef::Array(keys) => Ok(Some(keys.iter().map(extra_key).collect())),
            _ => Err(DecodeError::Shape("an extra_keys entry is not an array")),
        })
        .collect::<Result<_, _>>()?;
    Ok(Some(per_block))
}

fn extra_key(v: &ValueRef<'_>) -> ExtraKey {
    match v {
        ValueRef::String(s) => match s.as_str() {
            Some(s) => ExtraKey::Text(s.into()),
            None => ExtraKey::Other,
        },
        ValueRef::Array(_) => ExtraKey::Tuple,
        ValueRef::Binary(_) => ExtraKey::Bytes,
        _ => ExtraKey::Other,
    }
}
