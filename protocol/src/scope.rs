//! The topology unit a multi-GPU lease is kept within. Both ends of the
//! broker's API speak it (the client in a lease request, the broker's
//! placement when it chooses GPUs), so it lives here, below both, with the
//! conversions to and from its wire form ([`crate::broker_capnp::Scope`]).

use serde::{Deserialize, Serialize};

use crate::broker_capnp::Scope as WireScope;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Scope {
    #[default]
    Any,
    Node,
    Leaf,
    Spine,
}

impl Scope {
    pub fn name(self) -> &'static str {
        match self {
            Scope::Any => "any",
            Scope::Node => "node",
            Scope::Leaf => "leaf",
            Scope::Spine => "spine",
        }
    }

    /// Case-insensitive; `None` for anything but the four names.
    pub fn parse(s: &str) -> Option<Scope> {
        Some(match s.to_ascii_lowercase().as_str() {
            "any" => Scope::Any,
            "node" => Scope::Node,
            "leaf" => Scope::Leaf,
            "spine" => Scope::Spine,
            _ => return None,
        })
    }

    /// The scope of a received request: a value this build does not know
    /// (a newer peer's) constrains nothing.
    pub fn from_wire(w: Result<WireScope, capnp::NotInSchema>) -> Scope {
        w.map_or(Scope::Any, Scope::from)
    }
}

impl From<WireScope> for Scope {
    fn from(w: WireScope) -> Scope {
        match w {
            WireScope::Any => Scope::Any,
            WireScope::Node => Scope::Node,
            WireScope::Leaf => Scope::Leaf,
            WireScope::Spine => Scope::Spine,
        }
    }
}

impl From<Scope> for WireScope {
    fn from(s: Scope) -> WireScope {
        match s {
            Scope::Any => WireScope::Any,
            Scope::Node => WireScope::Node,
            Scope::Leaf => WireScope::Leaf,
            Scope::Spine => WireScope::Spine,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_survive_the_wire() {
        for s in [Scope::Any, Scope::Node, Scope::Leaf, Scope::Spine] {
            assert_eq!(Scope::parse(s.name()), Some(s));
            assert_eq!(Scope::parse(&s.name().to_uppercase()), Some(s));
            assert_eq!(Scope::from(WireScope::from(s)), s);
        }
        assert_eq!(Scope::parse("rack"), None);
        assert_eq!(Scope::from_wire(Err(capnp::NotInSchema(9))), Scope::Any);
    }
}
