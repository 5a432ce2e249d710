use std::collections::HashSet;

use crate::graph::CAPTURE_USE;
use crate::{Dim, Graph, IrError, IrResult, ValueKind};

impl Graph {
    /// Structural consistency of a top-level graph and all its subgraphs:
    /// * every node input and output exists, and every output has exactly that node as producer;
    /// * every node-output value has a producer; every constant has data whose type and shape
    ///   agree with the value's declared type;
    /// * value names are unique within each graph (and a subgraph does not redefine a name it
    ///   also reads from outside);
    /// * graph inputs are input values; graph outputs exist;
    /// * there is no cycle;
    /// * every name a subgraph reads from outside is defined by an enclosing graph; the
    ///   top-level graph reads nothing from outside.
    pub fn check(&self) -> IrResult<()> {
        self.check_in_scope(false)
    }

    fn check_in_scope(&self, nested: bool) -> IrResult<()> {
        let invalid = |what: String| IrError::Invalid { graph: self.name.clone(), what };
        let mut names = HashSet::new();
        let mut named = 0;
        for (id, v) in self.values() {
            if !v.name.is_empty() {
                named += 1;
                if !names.insert(v.name.as_str()) || self.value_by_name(&v.name) != Some(id) {
                    return Err(IrError::DuplicateValue { graph: self.name.clone(), value: v.name.clone() });
                }
            }
            match v.kind() {
                ValueKind::NodeOutput => {
                    let Some((n, i)) = v.producer() else {
                        return Err(invalid(format!("value '{}' has no producer", v.name)));
                    };
                    let node = self.node(n)?;
                    if node.output(i) != Some(id) {
                        return Err(invalid(format!("value '{}' names node '{}' as producer, which does not output it", v.name, node.name)));
                    }
                }
                ValueKind::Initializer if v.initializer().is_none() => {
                    return Err(invalid(format!("initializer '{}' has no data", v.name)));
                }
                ValueKind::Outer if !nested => {
                    return Err(invalid(format!("value '{}' is read but never defined", v.name)));
                }
                _ => {}
            }
            if v.kind() != ValueKind::NodeOutput && v.producer().is_some() {
                return Err(invalid(format!("{:?} value '{}' also has a producer", v.kind(), v.name)));
            }
            if let (Some(t), Some(ty)) = (v.initializer(), &v.ty) {
                let declared = ty.to_string();
                let elem_ok = ty.elem().is_none_or(|e| e == t.dtype());
                let shape_ok = ty.shape().is_none_or(|s| {
                    s.len() == t.rank() && s.iter().zip(t.shape()).all(|(d, &n)| !matches!(d, Dim::Known(k) if *k != n as i64))
                });
                if !elem_ok || !shape_ok {
                    return Err(IrError::TypeMismatch {
                        graph: self.name.clone(),
                        value: v.name.clone(),
                        declared,
                        actual: format!("its data is {}{:?}", t.dtype(), t.shape()),
                    });
                }
            }
            for &(n, i) in v.uses() {
                let node = self.node(n).map_err(|_| invalid(format!("value '{}' lists removed node #{} as a reader", v.name, n.0)))?;
                let ok = if i == CAPTURE_USE { node.captures().contains(&id) } else { node.input(i) == Some(id) };
                if !ok {
                    return Err(invalid(format!("value '{}' lists node '{}' as a reader, which does not read it", v.name, node.name)));
                }
            }
        }
        if named != self.by_name.len() {
            return Err(invalid("the name index is out of date".into()));
        }
        for v in &self.inputs {
            if self.value(*v)?.kind() != ValueKind::Input {
                return Err(invalid(format!("graph input '{}' is not an input value", self.value_name(*v))));
            }
        }
        for v in &self.outputs {
            self.value(*v).map_err(|_| invalid(format!("graph output #{} does not exist", v.0)))?;
        }
        for (id, node) in self.nodes() {
            let label = node.display_name(id);
            for v in node.inputs.iter().flatten() {
                let val = self.value(*v).map_err(|_| IrError::DanglingValue {
                    graph: self.name.clone(), node: label.clone(), op: node.op_type.clone(), value: v.0,
                })?;
                if !val.uses().iter().any(|u| u.0 == id) {
                    return Err(invalid(format!("node '{label}' reads '{}', which does not list it as a reader", val.name)));
                }
            }
            for (i, v) in node.outputs.iter().enumerate() {
                let Some(v) = v else { continue };
                let val = self.value(*v).map_err(|_| IrError::DanglingValue {
                    graph: self.name.clone(), node: label.clone(), op: node.op_type.clone(), value: v.0,
                })?;
                if val.producer() != Some((id, i)) {
                    return Err(IrError::DuplicateValue { graph: self.name.clone(), value: val.name.clone() });
                }
            }
            let captured: HashSet<String> = node.captures().iter().map(|v| self.value_name(*v)).collect();
            for (attr, sub) in node.subgraphs() {
                sub.check_in_scope(true).map_err(|e| match e {
                    IrError::Invalid { graph, what } => IrError::Invalid { graph: format!("{}/{label}.{attr}/{graph}", self.name), what },
                    e => e,
                })?;
                for outer in sub.outer_names() {
                    if !captured.contains(&outer) {
                        return Err(invalid(format!("subgraph '{attr}' of node '{label}' reads '{outer}', which the node does not capture")));
                    }
                }
            }
        }
        self.topo_order()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::{Attr, DType, Graph, Node, Tensor, ValueType};

    #[test]
    fn initializer_type_mismatch_is_caught() {
        let mut g = Graph::new("g");
        let w = g.add_initializer("w", Tensor::from_vec(&[2], vec![1f32, 2.]).unwrap()).unwrap();
        g.value_mut(w).unwrap().ty = Some(ValueType::tensor_of(DType::F32, &[3]));
        let e = g.check().unwrap_err();
        assert!(e.to_string().contains("'w' is declared float[3]"), "{e}");
    }

    #[test]
    fn subgraph_captures_resolve() {
        let mut body = Graph::new("then");
        let outer = body.add_outer("x").unwrap();
        let y = body.new_value("y", None).unwrap();
        body.add_node(Node::new("Identity", "id").with_inputs([outer]).with_outputs([y])).unwrap();
        body.set_outputs(vec![y]).unwrap();
        body.check().unwrap_err();

        let mut g = Graph::new("main");
        let c = g.add_input("c", Some(ValueType::tensor_of(DType::Bool, &[]))).unwrap();
        let x = g.add_input("x", None).unwrap();
        let out = g.new_value("out", None).unwrap();
        let n = g.add_node(Node::new("If", "if").with_inputs([c]).with_outputs([out])
            .with_attr("then_branch", Attr::Graph(Box::new(body.clone())))
            .with_attr("else_branch", Attr::Graph(Box::new(body)))).unwrap();
        g.set_outputs(vec![out]).unwrap();
        g.check().unwrap();
        assert_eq!(g.node(n).unwrap().captures(), &[x]);
        assert!(g.consumers(x).iter().any(|u| u.0 == n));
    }

    #[test]
    fn undefined_capture_at_top_level_is_an_error() {
        let mut body = Graph::new("b");
        let z = body.add_outer("nowhere").unwrap();
        body.set_outputs(vec![z]).unwrap();
        let mut g = Graph::new("main");
        let out = g.new_value("out", None).unwrap();
        g.add_node(Node::new("Loop", "loop").with_outputs([out]).with_attr("body", Attr::Graph(Box::new(body)))).unwrap();
        g.set_outputs(vec![out]).unwrap();
        let e = g.check().unwrap_err();
        assert!(e.to_string().contains("'nowhere' is read but never defined"), "{e}");
    }

    #[test]
    fn cycles_are_caught() {
        let mut g = Graph::new("g");
        let a = g.new_value("a", None).unwrap();
        let b = g.new_value("b", None).unwrap();
        g.add_node(Node::new("Relu", "r1").with_inputs([b]).with_outputs([a])).unwrap();
        g.add_node(Node::new("Relu", "r2").with_inputs([a]).with_outputs([b])).unwrap();
        g.set_outputs(vec![a]).unwrap();
        assert!(matches!(g.check(), Err(crate::IrError::Cycle { .. })));
    }
}

#[cfg(test)]
mod maintenance_tests {
    use crate::{Graph, Node, Tensor};

    #[test]
    fn dead_nodes_and_unused_constants_are_removed() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", None).unwrap();
        let c = g.add_initializer("c", Tensor::scalar(1f32)).unwrap();
        let unused = g.add_initializer("unused", Tensor::scalar(2f32)).unwrap();
        let a = g.new_value("a", None).unwrap();
        let dead = g.new_value("dead", None).unwrap();
        let dead2 = g.new_value("dead2", None).unwrap();
        g.add_node(Node::new("Add", "add").with_inputs([x, c]).with_outputs([a])).unwrap();
        g.add_node(Node::new("Neg", "neg").with_inputs([a]).with_outputs([dead])).unwrap();
        g.add_node(Node::new("Neg", "neg2").with_inputs([dead]).with_outputs([dead2])).unwrap();
        g.set_outputs(vec![a]).unwrap();
        assert_eq!(g.remove_dead_nodes(), 2);
        g.check().unwrap();
        assert_eq!(g.node_count(), 1);
        assert!(g.value(unused).is_err() && g.value(c).is_ok());
    }

    #[test]
    fn sorting_puts_producers_first() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", None).unwrap();
        let a = g.new_value("a", None).unwrap();
        let b = g.new_value("b", None).unwrap();
        g.add_node(Node::new("Neg", "second").with_inputs([a]).with_outputs([b])).unwrap();
        g.add_node(Node::new("Neg", "first").with_inputs([x]).with_outputs([a])).unwrap();
        g.set_outputs(vec![b]).unwrap();
        g.sort_nodes().unwrap();
        g.check().unwrap();
        let names: Vec<_> = g.nodes().map(|(_, n)| n.name.clone()).collect();
        assert_eq!(names, vec!["first", "second"]);
        assert_eq!(g.producer(b).map(|p| g.node(p.0).unwrap().name.clone()), Some("second".into()));
    }
}
