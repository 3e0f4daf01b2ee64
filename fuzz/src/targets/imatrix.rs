//! The imatrix reader (llama.cpp's GGUF imatrix files: `*.in_sum2` / `*.counts` pairs and the
//! dataset provenance). What it loads must give importances of the declared width and survive a
//! save/load round trip unchanged.

use hf2q_models::quantize::imatrix::Imatrix;

pub fn run(data: &[u8]) {
    let path = super::scratch_file("in.imatrix.gguf", data);
    let Ok(m) = Imatrix::load(&path) else { return };
    for (name, e) in &m.entries {
        let imp = m.get(name).expect("every entry has importances");
        assert_eq!(
            imp.len(),
            e.sums.len(),
            "'{name}': importance of the wrong width"
        );
    }
    let again = crate::scratch_dir().join("again.imatrix.gguf");
    if m.save(&again).is_ok() {
        let back = Imatrix::load(&again).expect("reading back a saved imatrix");
        assert_eq!(
            back.entries.len(),
            m.entries.len(),
            "entries lost in a round trip"
        );
        for (name, e) in &m.entries {
            let b = &back.entries[name];
            assert_eq!(
                format!("{:?}", (&e.sums, &e.counts)),
                format!("{:?}", (&b.sums, &b.counts)),
                "'{name}' changed in a round trip"
            );
        }
    }
}
