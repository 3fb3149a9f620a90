//! Policies by name, built exactly as the router builds them from its
//! configuration (`RawConfig::validate` → `PolicyConfig::build`), so the lab
//! runs the production parameters of every registered policy.

use kvroute_router::config::RawConfig;
use kvroute_router::policy::{POLICY_NAMES, Policy};

#[derive(Debug, thiserror::Error)]
#[error("unknown policy {name:?}; the router knows {}", POLICY_NAMES.join(", "))]
pub struct UnknownPolicy {
    pub name: String,
}

/// A factory for `name` (one fresh policy per router replica).
pub fn factory(name: &str) -> Result<impl Fn() -> Box<dyn Policy> + use<>, UnknownPolicy> {
    let config = RawConfig { policy: name.to_owned(), ..Default::default() }
        .validate()
        .map_err(|_| UnknownPolicy { name: name.to_owned() })?;
    Ok(move || config.policy.build())
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
        assert_eq!(default_policy(), "cache_aware");
    }
}
