"""decode: image files of every format the docs promise (PNG, JPEG, GIF, BMP; grey, RGB, with
alpha) as a model's grey or RGB input, and one-line errors for files that cannot be read."""

import io
import os
import shutil
import struct
import tempfile
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import model_registry
from gpipe_tf.train import decode

pytestmark = pytest.mark.unit

# ITU-R 601 luma, tf.image.rgb_to_grayscale's weights.
LUMA = np.array([0.2989, 0.5870, 0.1140])
# 2x2 RGB pixels, and the same as a GIF (PIL's, 4 colours, so exact).
RGB = np.array([[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [40, 80, 120]]], np.uint8)
RGB_GIF = (b'GIF87a\x02\x00\x02\x00\x81\x00\x00\x00\xff\x00(Px\xff\x00\x00\x00\x00\xff,\x00'
           b'\x00\x00\x00\x02\x00\x02\x00\x00\x08\x07\x00\x05\x00\x18\x10  \x00;')
GREY = np.array([[[0], [85]], [[170], [255]]], np.uint8)


def Bmp(pixels: np.ndarray) -> bytes:
    """An uncompressed BMP of uint8 pixels [height, width, 1 or 3]: 8 bits a pixel with a grey
    palette, or 24 (BGR); rows bottom-up, each padded to 4 bytes."""
    height, width, channels = pixels.shape
    palette = b''.join(bytes([i, i, i, 0]) for i in range(256)) if channels == 1 else b''
    rows = b''
    for row in pixels[::-1]:
        data = row[:, ::-1].tobytes()  # RGB as BGR (a grey row is one channel, unchanged).
        rows += data + b'\0' * (-len(data) % 4)
    offset = 14 + 40 + len(palette)
    return (b'BM' + struct.pack('<IHHI', offset + len(rows), 0, 0, offset) +
            struct.pack('<IiiHHIIiiII', 40, width, height, 1, 8 * channels, 0, len(rows), 2835,
                        2835, 256 if channels == 1 else 0, 0) + palette + rows)


class LoadImageTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.directory, ignore_errors=True)

    def Write(self, name: str, data: bytes) -> str:
        path = os.path.join(self.directory, name)
        with open(path, 'wb') as f:
            f.write(data)
        return path

    def Load(self, path: str, channels: int) -> np.ndarray:
        """The file as 2x2 input in [0, 1] (mean 0, std 1: no normalisation)."""
        return decode.LoadImage(path, decode.ImageSpec(size=2, channels=channels, mean=0.0,
                                                       std=1.0))

    def testGifAndBmpAsGreyForAOneChannelModel(self):
        want_grey = (RGB @ LUMA)[..., None] / 255.0
        self.assertAllClose(self.Load(self.Write('rgb.gif', RGB_GIF), 1), want_grey, atol=1e-6)
        self.assertAllClose(self.Load(self.Write('rgb.bmp', Bmp(RGB)), 1), want_grey, atol=1e-6)
        self.assertAllClose(self.Load(self.Write('grey.bmp', Bmp(GREY)), 1), GREY / 255.0)

    def testGreyAsRgbForAThreeChannelModel(self):
        want = np.repeat(GREY, 3, axis=-1) / 255.0
        self.assertAllClose(self.Load(self.Write('grey.bmp', Bmp(GREY)), 3), want)
        png = tf.io.encode_png(GREY).numpy()
        self.assertAllClose(self.Load(self.Write('grey.png', png), 3), want)
        self.assertAllClose(self.Load(self.Write('rgb.gif', RGB_GIF), 3), RGB / 255.0)

    def testAlphaIsDropped(self):
        rgba = np.concatenate([RGB, np.full([2, 2, 1], 7, np.uint8)], axis=-1)
        path = self.Write('rgba.png', tf.io.encode_png(rgba).numpy())
        self.assertAllClose(self.Load(path, 3), RGB / 255.0)
        self.assertAllClose(self.Load(path, 1), (RGB @ LUMA)[..., None] / 255.0, atol=1e-6)
        grey_alpha = np.concatenate([GREY, np.full([2, 2, 1], 7, np.uint8)], axis=-1)
        path = self.Write('grey_alpha.png', tf.io.encode_png(grey_alpha).numpy())
        self.assertAllClose(self.Load(path, 1), GREY / 255.0)

    def testCmykJpegAsGrey(self):
        try:
            from PIL import Image  # pylint: disable=g-import-not-at-top
        except ImportError:
            self.skipTest('PIL is not installed (it writes the CMYK JPEG)')
        cmyk = Image.fromarray(np.full([8, 8, 3], 128, np.uint8)).convert('CMYK')
        buffer = io.BytesIO()
        cmyk.save(buffer, 'JPEG', quality=100)
        got = decode.LoadImage(self.Write('cmyk.jpg', buffer.getvalue()),
                               decode.ImageSpec(size=8, channels=1, mean=0.0, std=1.0))
        self.assertAllClose(got, np.full([8, 8, 1], 128 / 255.0), atol=3 / 255.0)

    def testUnreadableFileIsOneLineNamingIt(self):
        path = self.Write('locked.png', tf.io.encode_png(GREY).numpy())
        denied = tf.errors.PermissionDeniedError(None, None, f'{path}; Permission denied')
        with mock.patch.object(tf.io.gfile, 'GFile', side_effect=denied):
            with self.assertRaisesRegex(
                    errors.InputError,
                    rf"^decode: cannot read the image file '{path}' \(permission denied\)\.$"):
                self.Load(path, 1)

    def testAHugePathIsCutInTheMessage(self):
        path = '/' + 'x' * 5_000_000
        with self.assertRaises(FileNotFoundError) as raised:
            self.Load(path, 1)
        self.assertEqual(str(raised.exception), f"decode: no image file '/{'x' * 79}'....")


class TranslationRequestTest(tf.test.TestCase):
    """What a translation request can be refused for, named as what it is."""

    def setUp(self):
        super().setUp()
        self.p = model_registry.GetParams('mt.multilingual.TransformerTiny', 'Test')

    def testASentenceTooLongIsNamedAsSuchNotAsTheLanguage(self):
        with self.assertRaises(errors.InputError) as raised:
            decode.CheckRequest(self.p, ['a' * 1000], 'de')
        self.assertStartsWith(str(raised.exception), 'decode: ')
        self.assertNotIn('--target_language', str(raised.exception))
        self.assertLess(len(str(raised.exception)), 400)

    def testAnUnknownLanguageIsNamedCut(self):
        with self.assertRaisesRegex(ValueError, r"^decode: --target_language='z{80}'\.\.\.: "
                                    r"Unknown target language 'z{80}'\.\.\."):
            decode.CheckRequest(self.p, ['hello'], 'z' * 500)
