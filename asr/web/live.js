// An AudioWorklet processor for "Live": the microphone's first channel, resampled to 16 kHz and
// posted to the page as little-endian int16 frames of FRAME samples (100 ms; an ArrayBuffer
// each, transferred), which the page sends over the WebSocket as they come. Posting "flush" to
// its port posts what is left of the last frame, then "flushed".
//
// Resampling from the context's rate (44.1 or 48 kHz, any rate works) is a windowed-sinc
// low-pass interpolator evaluated at each output instant: cutoff 7.2 kHz (0.9 x the 8 kHz
// Nyquist of 16 kHz), a Hann window HALF output samples wide on each side.
const RATE = 16000;
const FRAME = 1600;
const HALF = 8;

class Pcm16k extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / RATE;                // input samples per output sample
    this.cutoff = Math.min(1, RATE / sampleRate) * 0.9;  // of the input's Nyquist
    this.reach = Math.ceil(HALF * Math.max(1, this.step));  // input samples each side of an instant
    this.input = new Float32Array(0);             // input not yet consumed
    this.at = this.reach;                         // the next output instant, in `input` samples
    this.frame = new Int16Array(FRAME);
    this.filled = 0;
    this.port.onmessage = (e) => {
      if (e.data === "flush") {
        this.post(this.filled);
        this.port.postMessage("flushed");
      }
    };
  }

  post(n) {
    if (n === 0) return;
    const out = this.frame.slice(0, n);
    this.port.postMessage(out.buffer, [out.buffer]);
    this.filled = 0;
  }

  push(x) {
    this.frame[this.filled++] = Math.max(-32768, Math.min(32767, Math.round(x * 32768)));
    if (this.filled === FRAME) this.post(FRAME);
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    if (sampleRate === RATE) {
      for (let i = 0; i < channel.length; i++) this.push(channel[i]);
      return true;
    }
    const joined = new Float32Array(this.input.length + channel.length);
    joined.set(this.input);
    joined.set(channel, this.input.length);
    this.input = joined;
    const c = this.cutoff, r = this.reach;
    while (this.at + r < this.input.length) {
      const centre = Math.floor(this.at);
      let y = 0;
      for (let k = centre - r + 1; k <= centre + r; k++) {
        const d = this.at - k;                    // input samples from the instant
        const w = 0.5 + 0.5 * Math.cos(Math.PI * d / r);  // Hann
        y += this.input[k] * c * (d === 0 ? 1 : Math.sin(Math.PI * c * d) / (Math.PI * c * d)) * w;
      }
      this.push(y);
      this.at += this.step;
    }
    const drop = Math.max(0, Math.floor(this.at) - r);  // keep what the next instants reach back to
    this.input = this.input.slice(drop);
    this.at -= drop;
    return true;
  }
}
registerProcessor("pcm16k", Pcm16k);
