// An AudioWorklet processor that hands the microphone's samples (mono: the first channel) to the
// page in blocks; the page joins them into a WAV when recording stops.
class Recorder extends AudioWorkletProcessor {
  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) this.port.postMessage(channel.slice(0));
    return true;
  }
}
registerProcessor("recorder", Recorder);
