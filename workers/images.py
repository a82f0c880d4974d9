"""The images of a multimodal request, as the engine takes them (``multi_modal_data``).

The gateway checked, decoded and shrank each image already (platform/gateway/images.py); here the
bytes it stored with the request input (contract/protocol.py ``RequestInput.images``) are opened
again, off the engine's event loop.
"""

import base64
import io


def decode_images(images: list[dict]) -> dict:
    """``{"image": [PIL images in RGB]}`` for the request's images, in prompt order."""
    from PIL import Image

    decoded = []
    for image in images:
        with Image.open(io.BytesIO(base64.b64decode(image["data"]))) as opened:
            decoded.append(opened.convert("RGB"))
    return {"image": decoded}
