//! Identifier newtypes, so a worker id and a model name can never be swapped.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A vLLM worker as routers know it (the sidecar's `--worker-id`, or the id of a
/// static `--worker ID=URL`).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerId(String);

/// A served model name as clients request it: a base model or a LoRA adapter.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ModelName(String);

macro_rules! string_id {
    ($t:ident) => {
        impl $t {
            pub fn new(s: impl Into<String>) -> Self {
                $t(s.into())
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($t), self.0)
            }
        }
        impl From<&str> for $t {
            fn from(s: &str) -> Self {
                $t(s.to_owned())
            }
        }
    };
}

string_id!(WorkerId);
string_id!(ModelName);
