// A small MessagePack codec for the live socket's messages: maps, arrays, strings, binary,
// integers, floats, booleans and nil. The protocol uses no extension types, so none are read.

const utf8Encoder = new TextEncoder();
const utf8Decoder = new TextDecoder();

class Writer {
  constructor() {
    this.bytes = new Uint8Array(256);
    this.view = new DataView(this.bytes.buffer);
    this.length = 0;
  }

  reserve(count) {
    if (this.length + count <= this.bytes.length) return;
    const grown = new Uint8Array(Math.max(this.bytes.length * 2, this.length + count));
    grown.set(this.bytes.subarray(0, this.length));
    this.bytes = grown;
    this.view = new DataView(grown.buffer);
  }

  byte(value) {
    this.reserve(1);
    this.bytes[this.length++] = value;
  }

  // A type byte followed by a big-endian unsigned length or value of `size` bytes.
  head(type, size, value) {
    this.byte(type);
    this.reserve(size);
    if (size === 1) this.view.setUint8(this.length, value);
    else if (size === 2) this.view.setUint16(this.length, value);
    else if (size === 4) this.view.setUint32(this.length, value);
    else this.view.setBigUint64(this.length, BigInt(value));
    this.length += size;
  }

  raw(bytes) {
    this.reserve(bytes.length);
    this.bytes.set(bytes, this.length);
    this.length += bytes.length;
  }
}

function writeInteger(writer, value) {
  if (value >= 0) {
    if (value < 0x80) writer.byte(value);
    else if (value < 0x100) writer.head(0xcc, 1, value);
    else if (value < 0x10000) writer.head(0xcd, 2, value);
    else if (value < 0x100000000) writer.head(0xce, 4, value);
    else writer.head(0xcf, 8, value);
    return;
  }
  if (value >= -32) {
    writer.byte(value & 0xff);
    return;
  }
  // Negative: the smallest signed width that holds it.
  const widths = [[0xd0, 1, 0x80], [0xd1, 2, 0x8000], [0xd2, 4, 0x80000000]];
  for (const [type, size, limit] of widths) {
    if (value >= -limit) {
      writer.byte(type);
      writer.reserve(size);
      if (size === 1) writer.view.setInt8(writer.length, value);
      else if (size === 2) writer.view.setInt16(writer.length, value);
      else writer.view.setInt32(writer.length, value);
      writer.length += size;
      return;
    }
  }
  writer.byte(0xd3);
  writer.reserve(8);
  writer.view.setBigInt64(writer.length, BigInt(value));
  writer.length += 8;
}

function writeLength(writer, length, fixType, fixLimit, types) {
  if (fixType !== null && length < fixLimit) writer.byte(fixType | length);
  else if (length < 0x100 && types[0] !== null) writer.head(types[0], 1, length);
  else if (length < 0x10000) writer.head(types[1], 2, length);
  else writer.head(types[2], 4, length);
}

function writeValue(writer, value) {
  if (value === null || value === undefined) {
    writer.byte(0xc0);
  } else if (typeof value === "boolean") {
    writer.byte(value ? 0xc3 : 0xc2);
  } else if (typeof value === "number") {
    if (Number.isSafeInteger(value)) {
      writeInteger(writer, value);
    } else {
      writer.byte(0xcb);
      writer.reserve(8);
      writer.view.setFloat64(writer.length, value);
      writer.length += 8;
    }
  } else if (typeof value === "string") {
    const bytes = utf8Encoder.encode(value);
    writeLength(writer, bytes.length, 0xa0, 32, [0xd9, 0xda, 0xdb]);
    writer.raw(bytes);
  } else if (value instanceof Uint8Array || value instanceof ArrayBuffer) {
    const bytes = value instanceof Uint8Array ? value : new Uint8Array(value);
    writeLength(writer, bytes.length, null, 0, [0xc4, 0xc5, 0xc6]);
    writer.raw(bytes);
  } else if (Array.isArray(value)) {
    writeLength(writer, value.length, 0x90, 16, [null, 0xdc, 0xdd]);
    for (const item of value) writeValue(writer, item);
  } else if (typeof value === "object") {
    const entries = Object.entries(value).filter(([, item]) => item !== undefined);
    writeLength(writer, entries.length, 0x80, 16, [null, 0xde, 0xdf]);
    for (const [key, item] of entries) {
      writeValue(writer, key);
      writeValue(writer, item);
    }
  } else {
    throw new TypeError(`cannot encode a ${typeof value} as MessagePack`);
  }
}

export function encode(value) {
  const writer = new Writer();
  writeValue(writer, value);
  return writer.bytes.slice(0, writer.length);
}

class Reader {
  constructor(bytes) {
    this.bytes = bytes;
    this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    this.offset = 0;
  }

  take(count) {
    if (this.offset + count > this.bytes.length) throw new RangeError("truncated MessagePack data");
    const start = this.offset;
    this.offset += count;
    return start;
  }

  unsigned(size) {
    const at = this.take(size);
    if (size === 1) return this.view.getUint8(at);
    if (size === 2) return this.view.getUint16(at);
    if (size === 4) return this.view.getUint32(at);
    return Number(this.view.getBigUint64(at));
  }

  signed(size) {
    const at = this.take(size);
    if (size === 1) return this.view.getInt8(at);
    if (size === 2) return this.view.getInt16(at);
    if (size === 4) return this.view.getInt32(at);
    return Number(this.view.getBigInt64(at));
  }

  string(length) {
    const at = this.take(length);
    return utf8Decoder.decode(this.bytes.subarray(at, at + length));
  }

  binary(length) {
    const at = this.take(length);
    return this.bytes.slice(at, at + length);
  }

  array(length) {
    const items = [];
    for (let index = 0; index < length; index++) items.push(this.value());
    return items;
  }

  map(length) {
    const result = {};
    for (let index = 0; index < length; index++) {
      const key = this.value();
      result[String(key)] = this.value();
    }
    return result;
  }

  value() {
    const type = this.unsigned(1);
    if (type < 0x80) return type;
    if (type < 0x90) return this.map(type & 0x0f);
    if (type < 0xa0) return this.array(type & 0x0f);
    if (type < 0xc0) return this.string(type & 0x1f);
    if (type >= 0xe0) return type - 0x100;
    switch (type) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return this.binary(this.unsigned(1));
      case 0xc5: return this.binary(this.unsigned(2));
      case 0xc6: return this.binary(this.unsigned(4));
      case 0xca: return this.view.getFloat32(this.take(4));
      case 0xcb: return this.view.getFloat64(this.take(8));
      case 0xcc: return this.unsigned(1);
      case 0xcd: return this.unsigned(2);
      case 0xce: return this.unsigned(4);
      case 0xcf: return this.unsigned(8);
      case 0xd0: return this.signed(1);
      case 0xd1: return this.signed(2);
      case 0xd2: return this.signed(4);
      case 0xd3: return this.signed(8);
      case 0xd9: return this.string(this.unsigned(1));
      case 0xda: return this.string(this.unsigned(2));
      case 0xdb: return this.string(this.unsigned(4));
      case 0xdc: return this.array(this.unsigned(2));
      case 0xdd: return this.array(this.unsigned(4));
      case 0xde: return this.map(this.unsigned(2));
      case 0xdf: return this.map(this.unsigned(4));
      default: throw new TypeError(`unsupported MessagePack type 0x${type.toString(16)}`);
    }
  }
}

export function decode(data) {
  const bytes = data instanceof Uint8Array ? data : new Uint8Array(data);
  const reader = new Reader(bytes);
  const value = reader.value();
  if (reader.offset !== bytes.length) throw new RangeError("trailing bytes after a MessagePack value");
  return value;
}
