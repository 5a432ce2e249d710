//! Graph patterns as data.
//!
//! A pattern reads like the expression it matches: `Relu(Add(*, Conv))` is a Relu whose
//! input is an Add whose second input comes from a Conv; `*` matches any value, `A|B` either
//! op. A sequential list `["Conv", "BatchNormalization", "Relu"]` is the chain
//! `Relu(BatchNormalization(Conv))` through first inputs. Matching is anchored at the
//! pattern's outermost op, the last node of the computation, as in PyTorch's reverse nested
//! pattern format.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use qforge_ir::{Graph, NodeId};

/// A pattern over graph nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pattern {
    /// Any value, whatever produces it.
    Any,
    /// A node whose op type is one of `ops` (default domain), whose i-th input matches
    /// `inputs[i]` (inputs beyond the list are unconstrained).
    Op { ops: Vec<String>, inputs: Vec<Pattern> },
}

impl Pattern {
    pub fn op(op: &str) -> Pattern {
        Pattern::Op { ops: vec![op.to_string()], inputs: vec![] }
    }

    /// The chain `last(...(second(first)))` through first inputs.
    pub fn sequence<S: AsRef<str>>(ops: &[S]) -> Result<Pattern, String> {
        let mut it = ops.iter();
        let first = it.next().ok_or("an empty sequence is not a pattern")?;
        let mut p = Pattern::parse(first.as_ref())?;
        for op in it {
            let Pattern::Op { ops, .. } = Pattern::parse(op.as_ref())? else {
                return Err("'*' can only start a sequence".into());
            };
            p = Pattern::Op { ops, inputs: vec![p] };
        }
        Ok(p)
    }

    /// Parses `Op(arg, ...)`, `A|B`, and `*`.
    pub fn parse(text: &str) -> Result<Pattern, String> {
        let mut p = Parser { s: text.as_bytes(), i: 0 };
        let pat = p.pattern()?;
        p.ws();
        if p.i != p.s.len() {
            return Err(format!("unexpected '{}' at offset {} in pattern '{text}'", &text[p.i..], p.i));
        }
        Ok(pat)
    }

    /// Number of ops in the pattern.
    pub fn size(&self) -> usize {
        match self {
            Pattern::Any => 0,
            Pattern::Op { inputs, .. } => 1 + inputs.iter().map(Pattern::size).sum::<usize>(),
        }
    }

    /// Position of the root in a match: the innermost op along first inputs (`Conv` in
    /// `Relu(Conv)`, `Add` in `Relu(Add(*, Conv))`), which carries weight and bias inputs.
    pub fn root_index(&self) -> usize {
        match self {
            Pattern::Op { inputs, .. } => match inputs.first() {
                Some(first @ Pattern::Op { .. }) => 1 + first.root_index(),
                _ => 0,
            },
            Pattern::Any => 0,
        }
    }

    /// The op types the anchor (outermost op) may have.
    pub fn anchor_ops(&self) -> &[String] {
        match self {
            Pattern::Any => &[],
            Pattern::Op { ops, .. } => ops,
        }
    }

    /// Matches the pattern with its anchor at `node`. Returns the matched nodes, anchor first,
    /// then depth-first in input order. Every matched node except the anchor must have its
    /// output read only by the next node of the match and must not be a graph output, so the
    /// match can be quantized as one unit.
    pub fn match_at(&self, g: &Graph, node: NodeId) -> Option<Vec<NodeId>> {
        let mut out = vec![];
        self.match_rec(g, node, true, &mut out).then_some(out)
    }

    fn match_rec(&self, g: &Graph, id: NodeId, anchor: bool, out: &mut Vec<NodeId>) -> bool {
        let Pattern::Op { ops, inputs } = self else { return true };
        let Ok(node) = g.node(id) else { return false };
        if !(node.domain.is_empty() || node.domain == "ai.onnx") || !ops.contains(&node.op_type) {
            return false;
        }
        if !anchor {
            let outs: Vec<_> = node.outputs.iter().flatten().collect();
            if outs.len() != 1 || g.consumers(*outs[0]).len() != 1 || g.is_output(*outs[0]) {
                return false;
            }
        }
        out.push(id);
        for (i, p) in inputs.iter().enumerate() {
            if *p == Pattern::Any {
                continue;
            }
            let Some(v) = node.input(i) else { return false };
            let Some((producer, 0)) = g.producer(v) else { return false };
            if !p.match_rec(g, producer, false, out) {
                return false;
            }
        }
        true
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pattern::Any => f.write_str("*"),
            Pattern::Op { ops, inputs } => {
                f.write_str(&ops.join("|"))?;
                if !inputs.is_empty() {
                    let args: Vec<String> = inputs.iter().map(|p| p.to_string()).collect();
                    write!(f, "({})", args.join(", "))?;
                }
                Ok(())
            }
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn name(&mut self) -> Result<String, String> {
        self.ws();
        let start = self.i;
        while self.i < self.s.len() && (self.s[self.i].is_ascii_alphanumeric() || self.s[self.i] == b'_') {
            self.i += 1;
        }
        if start == self.i {
            return Err(format!("expected an op name at offset {start}"));
        }
        Ok(String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
    }

    fn eat(&mut self, c: u8) -> bool {
        self.ws();
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn pattern(&mut self) -> Result<Pattern, String> {
        if self.eat(b'*') {
            return Ok(Pattern::Any);
        }
        let mut ops = vec![self.name()?];
        while self.eat(b'|') {
            ops.push(self.name()?);
        }
        let mut inputs = vec![];
        if self.eat(b'(') {
            loop {
                inputs.push(self.pattern()?);
                if self.eat(b')') {
                    break;
                }
                if !self.eat(b',') {
                    return Err(format!("expected ',' or ')' at offset {}", self.i));
                }
            }
        }
        Ok(Pattern::Op { ops, inputs })
    }
}

/// In config files a pattern is a string (`"Relu(Add(*, Conv))"`) or a list of ops (a sequence).
impl<'de> Deserialize<'de> for Pattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Pattern, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            Text(String),
            Sequence(Vec<String>),
        }
        match Form::deserialize(d)? {
            Form::Text(t) => Pattern::parse(&t),
            Form::Sequence(s) => Pattern::sequence(&s),
        }
        .map_err(serde::de::Error::custom)
    }
}

impl Serialize for Pattern {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qforge_ir::{Node, ValueId};

    fn op(g: &mut Graph, op: &str, inputs: &[ValueId]) -> (NodeId, ValueId) {
        let name = g.unique_name(&op.to_lowercase());
        let out = g.new_value(name.clone(), None).unwrap();
        let n = g.add_node(Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([out])).unwrap();
        (n, out)
    }

    #[test]
    fn parse_and_print() {
        let p = Pattern::parse("Relu(Add(*, Conv|ConvTranspose))").unwrap();
        assert_eq!(p.to_string(), "Relu(Add(*, Conv|ConvTranspose))");
        assert_eq!(p.size(), 3);
        assert_eq!(p.root_index(), 1, "Add is the root of Relu(Add(*, Conv))");
        assert_eq!(Pattern::parse("Relu(Conv)").unwrap().root_index(), 1);
        assert_eq!(Pattern::parse("Conv").unwrap().root_index(), 0);
        assert_eq!(Pattern::sequence(&["Conv", "BatchNormalization", "Relu"]).unwrap().to_string(), "Relu(BatchNormalization(Conv))");
        assert!(Pattern::parse("Relu(").is_err());
        assert!(Pattern::parse("Relu) x").is_err());
    }

    #[test]
    fn matches_residual_block_and_respects_fanout() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", None).unwrap();
        let w = g.add_initializer("w", qforge_ir::Tensor::scalar(1f32)).unwrap();
        let (conv, c) = op(&mut g, "Conv", &[x, w]);
        let (add, a) = op(&mut g, "Add", &[x, c]);
        let (relu, r) = op(&mut g, "Relu", &[a]);
        g.set_outputs(vec![r]).unwrap();
        let p = Pattern::parse("Relu(Add(*, Conv))").unwrap();
        assert_eq!(p.match_at(&g, relu), Some(vec![relu, add, conv]));
        assert_eq!(p.match_at(&g, add), None);
        // A second reader of the Add output breaks the fusion.
        let (_, s) = op(&mut g, "Sigmoid", &[a]);
        g.set_outputs(vec![r, s]).unwrap();
        assert_eq!(p.match_at(&g, relu), None);
    }

    #[test]
    fn deserializes_both_forms() {
        #[derive(Deserialize)]
        struct T {
            a: Pattern,
            b: Pattern,
        }
        let t: T = toml::from_str("a = 'Relu(Add(*, Conv))'\nb = ['Conv', 'Relu']").unwrap();
        assert_eq!(t.b, Pattern::parse("Relu(Conv)").unwrap());
        assert_eq!(t.a.size(), 3);
    }
}
