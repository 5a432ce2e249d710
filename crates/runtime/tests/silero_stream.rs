//! silero-vad run statefully over a 10 s clip, chunk by chunk as silero's `OnnxWrapper` does,
//! gives the same speech probabilities as ONNX Runtime to 1e-5 on every chunk.

use qforge_ir::Tensor;
use qforge_runtime::Session;
use qforge_testkit::{oracle, real_models, TempDir};

/// 10 s at 16 kHz: noise, with voiced-like harmonic bursts (150-250 Hz fundamental, amplitude
/// modulated) in the middle of every second.
fn clip() -> Vec<f32> {
    let mut s = 0x2545F4914F6CDD1Du64;
    (0..160_000).map(|i| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let noise = ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02;
        let t = i as f32 / 16000.0;
        let in_burst = (t.fract() > 0.3) && (t.fract() < 0.8);
        let f0 = 150.0 + 100.0 * (t * 0.7).sin().abs();
        let voice: f32 = (1..6).map(|h| (2.0 * std::f32::consts::PI * f0 * h as f32 * t).sin() / h as f32).sum();
        noise + if in_burst { 0.3 * voice * (0.5 + 0.5 * (2.0 * std::f32::consts::PI * 4.0 * t).sin()) } else { 0.0 }
    }).collect()
}

#[test]
fn stateful_clip_matches_onnxruntime() {
    let m = real_models().into_iter().find(|m| m.name == "silero_vad_16k_op15").unwrap();
    let model = qforge_onnx::load(&m.path).unwrap();
    let session = Session::new(&model).unwrap();
    let audio = clip();
    let mut state = Tensor::zeros(qforge_ir::DType::F32, &[2, 1, 128]).unwrap();
    let mut context = vec![0f32; 64];
    let mut ours = vec![];
    for chunk in audio.chunks_exact(512) {
        let mut x = context.clone();
        x.extend_from_slice(chunk);
        let out = session.run(vec![
            ("input".into(), Tensor::from_vec(&[1, 576], x.clone()).unwrap()),
            ("state".into(), state.clone()),
            ("sr".into(), Tensor::scalar(16000i64)),
        ]).unwrap();
        ours.push(out[0].1.as_slice::<f32>().unwrap()[0]);
        state = out[1].1.clone();
        context = x[512..].to_vec();
    }
    let tmp = TempDir::new("silero");
    let audio_path = tmp.path().join("audio.npy");
    qforge_data::write_npy(&audio_path, &Tensor::from_vec(&[audio.len()], audio).unwrap()).unwrap();
    let probs_path = tmp.path().join("probs.npy");
    let out = oracle("silero_stream.py", &[m.path.as_os_str(), audio_path.as_os_str(), "-o".as_ref(), probs_path.as_os_str()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reference = qforge_data::read_npy(&probs_path).unwrap();
    let reference = reference.as_slice::<f32>().unwrap();
    assert_eq!(ours.len(), reference.len());
    assert_eq!(ours.len(), 312);
    let worst = ours.iter().zip(reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let speech = reference.iter().filter(|&&p| p > 0.5).count();
    println!("silero stream: {} chunks, {speech} above 0.5, max |diff| {worst:.3e}", ours.len());
    assert!(worst <= 1e-5, "max |diff| {worst}");
    assert!(speech > 0 && speech < ours.len(), "the clip should contain both speech-like and silent chunks");
}
