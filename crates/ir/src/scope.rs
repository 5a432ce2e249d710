/// The module path of a node, as a dotted scope (`encoder.layer.0.attention`).
///
/// PyTorch exporters name nodes after the module hierarchy: `/encoder/layer.0/attention/MatMul`
/// has scope `encoder.layer.0.attention`. TensorFlow-style names (`model/conv1/Conv2D`) work the
/// same way. Paddle exports name nodes `p2o.Conv.3` and outputs `conv2d_12.tmp_0`; there the
/// scope is taken from the first output name, up to its `.tmp` suffix (`conv2d_12`). Returns
/// an empty string when neither name carries a scope.
pub fn node_scope(node_name: &str, first_output: &str) -> String {
    let trimmed = node_name.trim_start_matches('/');
    if let Some((path, _op)) = trimmed.rsplit_once('/') {
        return path.split('/').filter(|s| !s.is_empty()).collect::<Vec<_>>().join(".");
    }
    if let Some((stem, _)) = first_output.split_once(".tmp") {
        return stem.to_string();
    }
    String::new()
}

#[cfg(test)]
mod tests {
    use super::node_scope;

    #[test]
    fn scopes() {
        assert_eq!(node_scope("/encoder/layer.0/attention/MatMul", "x"), "encoder.layer.0.attention");
        assert_eq!(node_scope("/MatMul", "x"), "");
        assert_eq!(node_scope("model/conv1/Conv2D", ""), "model.conv1");
        assert_eq!(node_scope("p2o.Conv.3", "conv2d_12.tmp_0"), "conv2d_12");
        assert_eq!(node_scope("Conv_0", "123"), "");
    }
}
