//! Fault injection: knobs set by flags at start and changed at runtime through
//! `POST /sim/faults`, so tests can make a worker lossy, silent, failing or slow.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    /// Fraction (0..=1) of event batches not sent on PUB (they still get a seq
    /// and stay in the replay buffer, as a batch lost in transit would).
    pub drop_events: f64,
    /// Hold event batches (in order) until resumed: a stalled publisher.
    pub pause_events: bool,
    /// Fraction (0..=1) of inference requests answered with `reject_status`.
    pub reject: f64,
    /// 503 (overloaded) or 500 (engine error).
    pub reject_status: u16,
    /// Multiplies every step's duration (≥ 1 slows the engine down).
    pub slowdown: f64,
}

impl Default for Faults {
    fn default() -> Self {
        Faults { drop_events: 0.0, pause_events: false, reject: 0.0, reject_status: 503, slowdown: 1.0 }
    }
}

/// A partial update: fields left out keep their value.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultsPatch {
    pub drop_events: Option<f64>,
    pub pause_events: Option<bool>,
    pub reject: Option<f64>,
    pub reject_status: Option<u16>,
    pub slowdown: Option<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    #[error("{field} must be between 0 and 1")]
    Fraction { field: &'static str },
    #[error("reject_status must be 500 or 503")]
    Status,
    #[error("slowdown must be a finite number > 0")]
    Slowdown,
}

impl FaultError {
    pub fn field(&self) -> &'static str {
        match self {
            FaultError::Fraction { field } => field,
            FaultError::Status => "reject_status",
            FaultError::Slowdown => "slowdown",
        }
    }
}

impl Faults {
    pub fn validate(&self) -> Result<(), FaultError> {
        for (field, v) in [("drop_events", self.drop_events), ("reject", self.reject)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(FaultError::Fraction { field });
            }
        }
        if !matches!(self.reject_status, 500 | 503) {
            return Err(FaultError::Status);
        }
        if !(self.slowdown.is_finite() && self.slowdown > 0.0) {
            return Err(FaultError::Slowdown);
        }
        Ok(())
    }

    /// The faults after `patch`, or why the result would be invalid.
    pub fn patched(&self, patch: FaultsPatch) -> Result<Faults, FaultError> {
        let next = Faults {
            drop_events: patch.drop_events.unwrap_or(self.drop_events),
            pause_events: patch.pause_events.unwrap_or(self.pause_events),
            reject: patch.reject.unwrap_or(self.reject),
            reject_status: patch.reject_status.unwrap_or(self.reject_status),
            slowdown: patch.slowdown.unwrap_or(self.slowdown),
        };
        next.validate()?;
        Ok(next)
    }
}
