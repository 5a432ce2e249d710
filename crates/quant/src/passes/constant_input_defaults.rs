use qforge_ir::Graph;

/// Treats the initializers that `g` also lists as graph inputs as constants: each becomes a
/// plain initializer and leaves the input list. ONNX IR version 3 required every initializer
/// to be an input, so models of that age (and converters that kept the habit) list every
/// weight as an overridable input; quantization bakes weights into integers either way, and
/// ONNX Runtime's quantizer takes any initializer as a constant. Without this, such weights
/// would be calibrated as activations and BatchNormalization would not fold. Returns the names
/// of the inputs turned into constants, in input order.
pub fn constant_input_defaults(g: &mut Graph) -> Vec<String> {
    let turned = g.make_input_defaults_constant();
    turned.into_iter().map(|v| g.value_name(v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use qforge_ir::{Node, Tensor};

    #[test]
    fn inputs_with_defaults_become_constants_and_others_stay_inputs() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", None).unwrap();
        let w = g.add_input("w", None).unwrap();
        g.set_initializer(w, Tensor::from_vec(&[2], vec![1.0f32, 2.0]).unwrap()).unwrap();
        let y = g.new_value("y", None).unwrap();
        g.add_node(Node::new("Mul", "mul").with_inputs([x, w]).with_outputs([y])).unwrap();
        g.set_outputs(vec![y]).unwrap();
        assert!(!g.value(w).unwrap().is_constant());
        assert_eq!(constant_input_defaults(&mut g), ["w"]);
        assert!(g.value(w).unwrap().is_constant());
        assert_eq!(g.inputs(), [x]);
        g.check().unwrap();
        assert!(constant_input_defaults(&mut g).is_empty());
    }
}
