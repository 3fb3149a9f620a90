//! Policies by name, built exactly as the router builds them from its
//! configuration (`RawConfig::validate` → `PolicyConfig::build`), so the lab
//! runs the production parameters of every registered policy.
//!
//! For tuning, a name may carry parameter overrides after a colon, joined by
//! `+` (commas separate policies on the command line):
//! `predicted_ttft:miss_weight=1+near_best=0.05`. They are applied to the
//! policy's parameter struct exactly as the router's config file would set them.

use kvroute_router::config::{PolicyConfig, RawConfig};
use kvroute_router::policy::{POLICY_NAMES, Policy};

#[derive(Debug, thiserror::Error)]
#[error("unknown policy {name:?}; the router knows {}{}", POLICY_NAMES.join(", "), .detail)]
pub struct UnknownPolicy {
    pub name: String,
    pub detail: String,
}

/// A factory for `name` (one fresh policy per router replica).
pub fn factory(name: &str) -> Result<impl Fn() -> Box<dyn Policy> + use<>, UnknownPolicy> {
    let unknown = |detail: String| UnknownPolicy { name: name.to_owned(), detail };
    let (base, overrides) = name.split_once(':').unwrap_or((name, ""));
    let config =
        RawConfig { policy: base.to_owned(), ..Default::default() }.validate().map_err(|_| unknown(String::new()))?;
    let mut policy = config.policy;
    if !overrides.is_empty() {
        let mut fields = serde_json::Map::new();
        for kv in overrides.split('+') {
            let (k, v) = kv.split_once('=').ok_or_else(|| unknown(format!(" ({kv:?} is not key=value)")))?;
            let v: serde_json::Value = v.parse().map_err(|_| unknown(format!(" ({v:?} is not a number)")))?;
            fields.insert(k.to_owned(), v);
        }
        let fields = serde_json::Value::Object(fields);
        let bad = |e: serde_json::Error| unknown(format!(" ({e})"));
        policy = match policy {
            PolicyConfig::CacheAware(_) => PolicyConfig::CacheAware(serde_json::from_value(fields).map_err(bad)?),
            PolicyConfig::PrefixThreshold(_) => {
                PolicyConfig::PrefixThreshold(serde_json::from_value(fields).map_err(bad)?)
            }
            PolicyConfig::PredictedTtft(_) => PolicyConfig::PredictedTtft(serde_json::from_value(fields).map_err(bad)?),
            PolicyConfig::DynamoKv(_) => PolicyConfig::DynamoKv(serde_json::from_value(fields).map_err(bad)?),
            PolicyConfig::LlmdWeighted(_) => PolicyConfig::LlmdWeighted(serde_json::from_value(fields).map_err(bad)?),
            PolicyConfig::Preble(_) => PolicyConfig::Preble(serde_json::from_value(fields).map_err(bad)?),
            _ => return Err(unknown(" (this policy takes no parameters)".into())),
        };
    }
    Ok(move || policy.build())
}

/// The router's default policy (`RawConfig::default().policy`).
pub fn default_policy() -> String {
    RawConfig::default().policy
}

pub fn all() -> &'static [&'static str] {
    POLICY_NAMES
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_router_policy_builds_and_unknown_names_are_refused() {
        for name in all() {
            assert_eq!(factory(name).unwrap()().name(), *name);
        }
        assert!(factory("nope").is_err());
        assert!(factory("preble:exploit_ratio=0.7").is_ok());
        assert!(factory("preble:no_such_knob=1").is_err());
        assert!(factory("round_robin:x=1").is_err());
        assert_eq!(default_policy(), "predicted_ttft");
    }
}
